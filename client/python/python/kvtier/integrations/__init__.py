"""Engine connectors: kvtier behind each engine's own plug-in interface.

- :mod:`kvtier.integrations.vllm`: an ``OffloadingSpec`` for vLLM's KV
  offloading framework (vLLM 0.33.0).
- :mod:`kvtier.integrations.vllm_tier`: a ``SecondaryTierManager`` behind
  the CPU tier of vLLM's own tiered offloading (``TieringOffloadingSpec``).
- :mod:`kvtier.integrations.sglang`: a HiCache L3 ``HiCacheStorage`` backend
  (SGLang 0.5.23).
- :mod:`kvtier.integrations.lmcache`: a ``StoragePluginInterface`` backend
  (LMCache 0.5.6).
- :mod:`kvtier.integrations.dynamo`: Dynamo's request hints (``nvext``)
  as kvtier hints, and its ``pin_prefix`` (Dynamo 1.6.1; imports no engine).

Each module imports its engine, so import only the one you use. Every
connector fails open: a miss, a timeout or a dead daemon means the engine
recomputes; it is logged (rate limited) and counted in the connector's
``counters`` (a :class:`Counters`). docs/OPERATIONS.md has the flags.
"""

from ._common import Counters, KvtierConfigError, connector_key

__all__ = ["Counters", "KvtierConfigError", "connector_key"]
