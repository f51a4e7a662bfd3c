"""The remote tier: features shared across processes and nodes through Redis or Valkey.

`RemoteStore` is what the cache needs of a store; `RedisStore` is the one it ships;
`RemoteTier` is the cache's side of it. The value format is in `codec`.
"""

from mmcache.remote.codec import RemoteValueError
from mmcache.remote.store import RemoteStore, WrongTypeError

__all__ = ["RemoteStore", "RemoteValueError", "WrongTypeError"]
