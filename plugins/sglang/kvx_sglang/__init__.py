"""kvx for SGLang: HiCache storage backend (``HiCacheKVX``) and PD transfer backend."""
