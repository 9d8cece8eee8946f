"""LMCache's plugins: the ``native_plugin`` L2 adapter (``l2``) and the in-engine remote
connector (``remote``, built by ``adapter``). Importing this package needs no lmcache."""
