"""Mooncake Store as the fleet's shared tier: `MooncakeStore` adapts Mooncake's
`MooncakeDistributedStore` (the `mooncake-transfer-engine` wheels' only store binding: they
ship no C ABI) to the protocol `KvManager.set_shared_store` calls. The entries are the file
tier's bytes (header, layout id, checksummed payload), checked in Rust before a byte reaches
the pool; this module only moves them. docs/fleet.md says why here and not in Rust.

    store = MooncakeStore.connect("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    manager.set_shared_store(store, capacity_bytes=store.segment_bytes)
"""


class MooncakeError(OSError):
    """A Mooncake call returned an error code (the manager counts it as a miss)."""


def _ok(what, code):
    if code != 0:
        raise MooncakeError(f"mooncake {what}: error {code}")


class MooncakeStore:
    """The shared-tier store protocol over a `MooncakeDistributedStore` already set up."""

    def __init__(self, store, segment_bytes=0):
        self.store = store
        self.segment_bytes = segment_bytes
        # Every key this process put, in order (what a test or an operator can look up:
        # Mooncake lists no keys).
        self.put_keys = []
        self.closed = False

    @classmethod
    def connect(cls, master, metadata_server, local_hostname="127.0.0.1", segment_bytes=1 << 30,
                buffer_bytes=64 << 20, protocol="tcp", device=""):
        """A client of the master at `master` (`host:port`) with its metadata server
        (`http://host:port/metadata`, or `P2PHANDSHAKE`), mounting a segment of
        `segment_bytes` of this process's memory into the store."""
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
        _ok("setup", s.setup(local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, device,
                             master))
        return cls(s, segment_bytes)

    def _open(self):
        # Mooncake's client crashes when called after close(): a closed store is an error.
        if self.closed:
            raise MooncakeError("the store is closed")
        return self.store

    def register_buffer(self, addr, size):
        _ok("register_buffer", self._open().register_buffer(addr, size))

    def unregister_buffer(self, addr):
        # A tier dropped after close() gives its buffer back to nothing: close() released it.
        if not self.closed:
            _ok("unregister_buffer", self.store.unregister_buffer(addr))

    def exist(self, keys):
        codes = self._open().batch_is_exist(keys)
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            raise MooncakeError(f"mooncake batch_is_exist: {codes[:8]}")
        return [c == 1 for c in codes]

    def size(self, key):
        n = self._open().get_size(key)
        if n >= 0:
            return n
        # A negative size is "no such key" or a failure: which one, the existence check says.
        e = self.store.is_exist(key)
        if e == 0:
            return None
        raise MooncakeError(f"mooncake get_size {key}: error {n} (is_exist {e})")

    def put(self, key, addr, size):
        _ok("put_from", self._open().put_from(key, addr, size))
        self.put_keys.append(key)

    def get_into(self, key, addr, size):
        n = self._open().get_into(key, addr, size)
        if n != size:
            raise MooncakeError(f"mooncake get_into {key}: {n} of {size} bytes")

    def remove(self, key):
        # Forced: a refused entry goes even while a reader holds its lease.
        return self._open().remove(key, True) == 0

    def close(self):
        if not self.closed:
            self.closed = True
            self.store.close()
