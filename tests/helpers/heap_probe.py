"""Where glibc puts a large tensor, for the script of a subprocess (malloc settings such as
``gcutil.keep_freed_memory`` last for the process that makes them)."""

#: defines ``where_a_large_tensor_lives()``: "heap" (glibc's heap, kept when freed) or
#: "mapping" (a mapping of its own, unmapped when freed)
WHERE_A_LARGE_TENSOR_LIVES = r"""
def where_a_large_tensor_lives():
    import torch

    t = torch.empty(64 * 2**20, dtype=torch.uint8)  # alive while the maps are read
    ptr = t.data_ptr()
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            return "heap" if line.rstrip().endswith("[heap]") else "mapping"
    return "unmapped"
"""
