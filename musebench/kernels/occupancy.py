"""How many CTAs of a compiled kernel one GPU holds at once: the CUDA occupancy API on its cubin.

Virtual ranks put every rank's grid on one GPU, and a Lamport wait only ends when the peers'
CTAs run. The kernel modules describe each launch of one rank (`LaunchDemand`); `group_load`
adds up what `ranks` copies of those launches need of the GPU, kernel by kernel, from the
occupancy API's answer for that kernel (clusters included: `cuOccupancyMaxActiveClusters`), and
a load above 1.0 does not fit. What a launch needs depends on who waits for whom:

- by default every CTA may wait for any peer's CTAs: all `ranks` grids must be resident at once;
- a launch with `wait_groups` G splits into G independent groups of one unit (a CTA, or a
  cluster) per rank, units waiting only within their group (the TP tail: the units of one
  (band, slot, owner) on every rank). Whatever the scheduler holds, G * (ranks - 1) + 1 resident
  units contain a whole group, which completes and frees its room; by induction all complete.
  So that many units, not all G * ranks, must fit.

The kernels are compiled with `KeepCUBIN` (musebench.kernels.compilation), so the cubin is at
hand; it is loaded into the current context for the query only, then unloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NON_PORTABLE_CLUSTER = 8  # clusters above 8 CTAs need the non-portable attribute


@dataclass(frozen=True)
class LaunchDemand:
    """One launch of one rank: a compiled CuTe DSL function and its launch geometry."""

    compiled: Any
    ctas: int
    threads: int
    smem_bytes: int = 0
    cluster: int = 1
    wait_groups: int = 0  # > 0: the units form this many independent wait groups (module doc)

    def needed_ctas(self, ranks: int) -> int:
        """CTAs that must be resident together for `ranks` copies of this launch to progress."""
        if self.wait_groups <= 0 or ranks == 1:
            return ranks * self.ctas
        units = self.ctas // self.cluster  # this rank's units: wait_groups of them
        if units != self.wait_groups:
            raise ValueError(f"{units} units per rank but {self.wait_groups} wait groups")
        return (self.wait_groups * (ranks - 1) + 1) * self.cluster


def _checked(result):
    error, *values = result
    from cuda.bindings import driver

    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {error} in the occupancy query")
    return values[0] if len(values) == 1 else values


def resident_ctas(demand: LaunchDemand, sm_count: int) -> int:
    """CTAs of this kernel the whole GPU holds at once (needs the CUDA context of the GPU)."""
    from cuda.bindings import driver

    cubin = demand.compiled.__cubin__
    if not cubin:
        raise RuntimeError("the kernel was compiled without its cubin (KeepCUBIN)")
    (name,) = tuple(demand.compiled.kernel_info)
    module = _checked(driver.cuModuleLoadData(cubin))
    try:
        function = _checked(driver.cuModuleGetFunction(module, name.encode()))
        if demand.cluster == 1:
            per_sm = _checked(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, demand.threads, demand.smem_bytes))
            return int(per_sm) * sm_count
        if demand.cluster > NON_PORTABLE_CLUSTER:
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            _checked((driver.cuFuncSetAttribute(function, attribute, 1)[0], None))
        cluster = driver.CUlaunchAttribute()
        cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = demand.cluster, 1, 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = demand.cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = demand.threads, 1, 1
        config.sharedMemBytes = demand.smem_bytes
        config.attrs = [cluster]
        config.numAttrs = 1
        return int(_checked(driver.cuOccupancyMaxActiveClusters(function, config))) * demand.cluster
    finally:
        driver.cuModuleUnload(module)


def group_load(demands: list[LaunchDemand], ranks: int, resident: list[int]) -> float:
    """Fraction of the GPU that `ranks` copies of the launches need at once (> 1.0: they may not progress)."""
    load = 0.0
    for demand, capacity in zip(demands, resident, strict=True):
        if capacity <= 0:
            return float("inf")
        load += demand.needed_ctas(ranks) / capacity
    return load
