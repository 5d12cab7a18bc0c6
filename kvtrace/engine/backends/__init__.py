"""Cache backends the engine's scheduler can drive.

* kvtrace's own ``kvtrace.cache.KVCacheManager`` (the default, imported directly);
* ``kvtrace.engine.backends.vllm``: the installed vLLM's own scheduler-side
  ``KVCacheManager``, adapted to the calls the scheduler makes (the reference of
  ``kvtrace conformance``). It is the only place in kvtrace that imports vllm, and only
  when it is installed (``make vllm``).
"""

# --backend's choices; the first is the default
from kvtrace.names import BACKENDS as BACKENDS
from kvtrace.names import KVTRACE
from kvtrace.names import VLLM as VLLM

DEFAULT_BACKEND = KVTRACE
