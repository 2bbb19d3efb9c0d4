"""The device under the allocator: cudaMalloc / cudaFree and the virtual-memory calls of expandable
segments. The simulated device hands out addresses itself and fails when physical memory runs out."""

_PAGE_BYTES = 2 * 1024 * 1024
_TOP_ADDR = 0x7F00_0000_0000  # simulated cudaMalloc addresses descend from here
_FIRST_RANGE = 0x1_0000_0000_0000  # where simulated virtual reservations start


class SimulatedDevice:
    """`capacity_bytes` of physical memory (None: unlimited). Each cudaMalloc gets an address below every
    earlier one and addresses are never reused. The order matters: best fit breaks ties between free blocks of
    equal size by address, which decides the segment that gets split. CUDA's driver hands out mostly
    descending addresses (this project's H200 traces, docs/allocator.md); ascending ones put the FSDP2 trace's
    reserved peak 52 MiB low, descending ones reproduce it."""

    def __init__(self, capacity_bytes=None, total_bytes=None):
        self.capacity_bytes = capacity_bytes
        self.total_bytes = total_bytes
        self.used_bytes = 0
        self._next_addr = _TOP_ADDR
        self._next_range = _FIRST_RANGE

    def _take(self, size):
        if self.capacity_bytes is not None and self.used_bytes + size > self.capacity_bytes:
            return False
        self.used_bytes += size
        return True

    def malloc(self, size, stream):
        if not self._take(size):
            return None
        self._next_addr -= -(-size // _PAGE_BYTES) * _PAGE_BYTES
        return self._next_addr

    def free(self, addr, size):
        self.used_bytes -= size

    def reserve_range(self, size, stream, small):
        base = self._next_range
        self._next_range += -(-size // _PAGE_BYTES) * _PAGE_BYTES
        return base

    def map(self, addr, size, stream):
        return self._take(size)

    def unmap(self, addr, size):
        self.used_bytes -= size

    def release_range(self, base, size):
        pass
