"""Build the native extension kvx._native (metadata lives in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvx._native",
            sources=["native/kvx_native.c", "native/kvx_copy.c", "native/kvx_jobs.c", "native/kvx_gpu.c"],
            depends=["native/kvx_buf.h", "native/kvx_native.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvx._net",
            sources=["native/kvx_net.c"],
            depends=["native/kvx_buf.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
        ),
    ]
)
