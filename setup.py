"""Build the native extension kvx._native (metadata lives in pyproject.toml)."""

from setuptools import Extension, setup


# ---- optional: kvx._ucx (the ucx backend), built only where the libucx wheel's headers are ----
def _ucx_extensions() -> list[Extension]:
    """kvx._ucx when UCX 1.22 (``pip install libucx-cu12``/``-cu13``) is installed in this
    environment; without it the build goes on and the ucx backend reports itself unavailable."""
    import importlib.util
    import os
    import sys
    import sysconfig

    homes = []
    spec = importlib.util.find_spec("libucx")  # wherever Python imports it from (venv, --target dir)
    if spec is not None and spec.submodule_search_locations:
        homes += list(spec.submodule_search_locations)
    for key in ("purelib", "platlib"):
        homes.append(os.path.join(sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})[key],
                                  "libucx"))
    for home in homes:
        if os.path.isfile(os.path.join(home, "include", "ucp", "api", "ucp.h")):
            lib = os.path.join(home, "lib")
            return [Extension(
                "kvx._ucx",
                sources=["native/kvx_ucx.c"],
                include_dirs=[os.path.join(home, "include")],
                library_dirs=[lib],
                libraries=["ucp", "ucs"],
                extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
                extra_link_args=["-pthread", f"-Wl,-rpath,{lib}"],
            )]
    return []


setup(
    ext_modules=_ucx_extensions() + [
        Extension(
            "kvx._native",
            sources=["native/kvx_native.c", "native/kvx_copy.c", "native/kvx_jobs.c", "native/kvx_gpu.c",
                     "native/kvx_hash.c", "native/kvx_strided.c"],
            depends=["native/kvx_buf.h", "native/kvx_native.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvx._net",
            sources=["native/kvx_net.c", "native/kvx_hash.c"],
            depends=["native/kvx_buf.h", "native/kvx_native.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
        ),
    ]
)
