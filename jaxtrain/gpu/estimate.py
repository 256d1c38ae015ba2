"""A step's time on GPUs, estimated from its compiled program: an ESTIMATE, never a measurement.

The scheduled per-GPU program (``compiled.as_text()``) is walked in order on three streams, compute,
communication and host transfers, as XLA:GPU runs it:

- each kernel (fusion, cuDNN convolution, cuBLAS / Triton gemm, copy...) takes its roofline time, the larger of
  FLOPs at the target's dense peak for its operands' dtype (f32 matmuls: TF32) and bytes (operands + result) at
  the HBM bandwidth; ``expected`` divides it by the share of the rooflines real kernels reach (``efficiency``,
  the one fitted constant: ``python -m experiments.gpu_validate``) and adds a fixed launch cost; the lower
  bound has neither;
- each collective takes an alpha-beta time on the link that carries it (NVLink/NVSwitch within a host, the
  network where a replica group spans hosts), as NCCL's own cost model gives it: a ring's latency (base + one
  hop per step, network hops for the steps that cross hosts) plus the bytes it moves per GPU (all-reduce
  2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, permute 1) at the link's bandwidth, or for an
  all-reduce a tree's (log2 of the hosts in network hops), the fastest of its LL and Simple protocols;
- an async collective (``-start`` ... ``-done``) runs beside the kernels scheduled between its start and its done;
  a sync one, and a ``-done`` reached before its transfer ends, stall the compute stream;
- a value moved to or from the host's memory (remat's offload: XLA's memory space 5, by an async copy or an
  async fusion) takes its bytes at the host link's bandwidth (PCIe) on a stream of its own; the kernels wait at
  its ``-done``; bytes a kernel itself reads or writes there count at that bandwidth too;
- a while loop's body counts its known trip count times.

Every constant is in ``targets.json`` with its source (``targets.costs()``).
"""

from __future__ import annotations

import math
import re

from jaxtrain.analysis import hlo
from jaxtrain.gpu.estimated import Estimate, OpTime
from jaxtrain.gpu.targets import Target, costs, target

_FREE = hlo.NOT_KERNELS | {"copy-start"}  # a copy within the device's memory: taken as free
_RING_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "all-gather": lambda n: n - 1,
               "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: n - 1,
               "collective-permute": lambda n: 1, "collective-broadcast": lambda n: n - 1}
_COLLECTIVE = re.compile(r"^(" + "|".join(_RING_STEPS) + r")(-start|-done)?$")
# An HLO dtype -> the precision whose peak it runs at (Target.peak_flops: f32 matmuls at TF32).
_PRECISION = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "s8": "int8", "u8": "int8", "f64": "fp64"}
# Precision.HIGHEST on any operand, as a dot prints it ({highest,highest}) or a cuBLAS call's backend_config
# (["HIGHEST","HIGHEST"]): XLA then runs an f32 matmul at full fp32, not TF32 (GetBlasComputationType).
_HIGHEST = re.compile(r'operand_precision(?:=\{[^}]*|":\[[^\]]*)highest', re.IGNORECASE)


def _peak(t: Target, operand_shape: str, attrs: str) -> float:
    dtype = hlo.arrays(operand_shape)[0][0]
    if dtype == "f32" and _HIGHEST.search(attrs):
        return t.peak_tflops["fp32"] * 1e12
    return t.peak_flops("fp8" if dtype.startswith("f8") else _PRECISION.get(dtype, "fp32"))


class _Walker:
    def __init__(self, comps: dict, t: Target, gpus: int, hosts: int, expected: bool):
        self.comps, self.t, self.gpus, self.hosts = comps, t, gpus, hosts
        self.c = costs()
        self.launch = self.c.launch_us * 1e-6 if expected else 0.0
        self.efficiency = self.c.efficiency if expected else 1.0
        self.shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
        self.ops: dict[str, OpTime] = {}
        self.main_peak: tuple[float, float] = (0.0, t.peak_flops("fp32"))  # (largest flops, its peak)

    def _record(self, instr, kind, count, flops, nbytes, seconds, bound):
        label = re.search(r'op_name="([^"]*)"', instr.attrs)
        label = re.sub(r"[()]", "", label.group(1).rsplit("/", 1)[-1].split(":")[0]) if label else instr.opcode
        op = self.ops.setdefault(instr.name, OpTime(instr.name, kind, label, 0, 0.0, 0.0, 0.0, bound))
        op.count += count
        op.flops += flops * count
        op.bytes += nbytes * count
        op.seconds += seconds * count

    def _matmuls(self, instr) -> tuple[str, float, float]:
        """(kind, FLOPs, peak) of a kernel: its dots / convolutions, fused or cuDNN / cuBLAS calls."""
        target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
        if instr.opcode == "custom-call" and target:
            if target.group(1).startswith("__cudnn$conv"):
                return "conv", hlo.conv_flops(instr, self.shapes), _peak(self.t, self.shapes[instr.operands[0]],
                                                                          instr.attrs)
            if target.group(1).startswith("__cublas"):
                return "matmul", hlo.gemm_flops(instr, self.shapes), _peak(self.t, self.shapes[instr.operands[0]],
                                                                            instr.attrs)
        if instr.opcode in ("dot", "convolution"):
            inner = [instr]
        elif instr.opcode == "fusion":
            inner = [i for name in instr.calls() for i in self.comps.get(name, ())
                     if i.opcode in ("dot", "convolution")]
        else:
            inner = []
        flops, peak, kind = 0.0, self.t.peak_flops("fp32"), "memory"
        for i in inner:
            kind = "matmul" if i.opcode == "dot" else "conv"
            flops += hlo.dot_flops(i, self.shapes) if i.opcode == "dot" else hlo.conv_flops(i, self.shapes)
            peak = _peak(self.t, self.shapes[i.operands[0]], i.attrs)
        return kind, flops, peak

    def _collective_seconds(self, kind: str, instr) -> tuple[float, float]:
        """(seconds, bytes per GPU) of one collective: NCCL's model, its fastest algorithm and protocol."""
        from jaxtrain.analysis.diagnostics import collective_op

        op = collective_op(instr.line)
        size = op[1] if op else hlo.nbytes(instr.shape)
        groups = hlo.replica_groups(instr.attrs, self.gpus * self.hosts)
        n = max(len(g) for g in groups)
        if n <= 1:
            return 0.0, size
        hosts = max(len({d // self.gpus for d in g}) for g in groups)
        link = (self.t.network_gbps_per_gpu if hosts > 1 else self.t.nvlink_gbps / 2) * 1e9
        steps = _RING_STEPS[kind](n)
        across = _RING_STEPS[kind](hosts) if hosts > 1 else 0  # the ring's steps that cross hosts
        moved = size * steps / n if kind != "collective-permute" else size
        model = self.c.protocols
        times = [(p["base_us"] + (steps - across) * p["nvlink_hop_us"] + across * p["network_hop_us"]) * 1e-6
                 + moved / (link * p["bandwidth_share"]) for p in model["ring"].values()]
        if kind == "all-reduce":
            cap = model["tree_max_bus_gbps" if hosts <= 2 else "tree_max_bus_gbps_beyond_2_hosts"] * 1e9
            bus = min(link * model["tree_bus_share"], cap)
            times += [(p["base_us"] + 2 * ((n // hosts - 1) * p["nvlink_hop_us"]
                                           + math.log2(hosts) * p["network_hop_us"]))
                      * 1e-6 + size / (0.5 * bus * p["bandwidth_share"]) for p in model["tree"].values()]
        return min(times), size

    def walk(self, comp: str, count: int = 1) -> dict:
        """Simulate one run of ``comp``: the clocks of its three streams (kernels, collectives, host transfers)
        and the time per class."""
        clock = comm_free = host_free = 0.0
        pending: dict[str, float] = {}  # async start name -> when its transfer ends
        totals = {"compute": 0.0, "memory": 0.0, "launch": 0.0, "communication": 0.0, "roofline": 0.0,
                  "to_host": 0.0, "from_host": 0.0, "host_seconds": 0.0, "host_wait": 0.0}
        for instr in self.comps[comp]:
            op = instr.opcode
            m = _COLLECTIVE.match(op)
            wrapped = op == "async-start" and any(
                _COLLECTIVE.match(i.opcode) for c in instr.calls() for i in self.comps.get(c, ()))
            if op == "async-done":  # an async collective's end (another async op's end is no kernel of its own)
                clock = max(clock, pending.pop(instr.operands[0] if instr.operands else "", clock))
                continue
            if op.endswith("-done") and not m:  # an async op's end: a host transfer's (below) is waited for here
                ends = pending.pop(instr.operands[0] if instr.operands else "", clock)
                totals["host_wait"] += max(0.0, ends - clock)
                clock = max(clock, ends)
                continue
            to_host, from_host = (0.0, 0.0) if m or wrapped else hlo.host_traffic(instr, self.comps, self.shapes)
            host = (to_host + from_host) / (self.t.host_link_gbps * 1e9) / self.efficiency
            totals["to_host"] += to_host
            totals["from_host"] += from_host
            totals["host_seconds"] += host
            if host and op in ("copy-start", "fusion-start"):  # an async transfer: on the host link, beside kernels
                host_free = max(clock, host_free) + host
                pending[instr.name] = host_free
                self._record(instr, "host transfer", count, 0.0, to_host + from_host, host, "host link")
                continue
            if op in _FREE or hlo.ALLOCATION in instr.attrs:
                continue
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
                n = int(trips.group(1)) if trips else 1
                body = re.search(r"body=%([^,\s]+)", instr.attrs).group(1)
                inner = self.walk(body, count * n)
                clock = max(clock, comm_free) + inner["seconds"] * n
                for k in totals:
                    totals[k] += inner[k] * n
                continue
            if op in ("call", "conditional"):
                inner = self.walk(instr.calls()[0], count)
                clock += inner["seconds"]
                for k in totals:
                    totals[k] += inner[k]
                continue
            if m or wrapped:
                if m and m.group(2) == "-done":
                    source = instr.operands[0] if instr.operands else ""
                    clock = max(clock, pending.pop(source, clock))
                    continue
                kind = m.group(1) if m else next(
                    _COLLECTIVE.match(i.opcode).group(1) for c in instr.calls() for i in self.comps.get(c, ())
                    if _COLLECTIVE.match(i.opcode))
                seconds, size = self._collective_seconds(kind, instr)
                begin = max(clock, comm_free)
                comm_free = begin + seconds
                totals["communication"] += seconds
                asynchronous = (m and m.group(2) == "-start") or wrapped
                if asynchronous and '"is_sync":true' not in instr.attrs:
                    pending[instr.name] = comm_free
                else:
                    clock = comm_free
                self._record(instr, kind, count, 0.0, size, seconds, "communication")
                continue
            kind, flops, peak = self._matmuls(instr)
            nbytes = hlo.kernel_bytes(instr, self.comps, self.shapes)
            compute = flops / peak
            memory = ((nbytes - to_host - from_host) / (self.t.memory_bandwidth_gbps * 1e9)
                      + (to_host + from_host) / (self.t.host_link_gbps * 1e9))
            launch = self.launch
            roofline = max(compute, memory) / self.efficiency
            clock += roofline + launch
            bound = "compute" if compute >= memory else "memory"
            if launch > roofline:
                bound = "launch"
            totals[bound if bound != "launch" else ("compute" if compute >= memory else "memory")] += roofline
            totals["launch"] += launch
            totals["roofline"] += roofline
            if flops > self.main_peak[0]:
                self.main_peak = (flops, peak)
            self._record(instr, kind, count, flops, nbytes, roofline + launch, bound)
        end = max([clock, comm_free, host_free, *pending.values()])
        totals["host_wait"] += max(0.0, host_free - max(clock, comm_free))
        return {**totals, "seconds": end}


def estimate(compiled_text: str, gpu: str | Target, gpus: int, hosts: int, examples: int,
             model_flops_per_example: float | None = None) -> Estimate:
    """The step time of a program compiled for ``gpus`` x ``hosts`` GPUs of kind ``gpu`` (``compiled.as_text()``
    of a step compiled by ``jaxtrain.gpu``), one call of ``examples`` examples (the global batch);
    ``model_flops_per_example``: the model's forward FLOPs (``jaxtrain.models.flops.forward``), for the MFU."""
    from jaxtrain.models.flops import TRAIN_FACTOR

    t = target(gpu)
    comps = hlo.computations(compiled_text)
    entry = hlo.entry_name(compiled_text)
    low = _Walker(comps, t, gpus, hosts, expected=False).walk(entry)
    walker = _Walker(comps, t, gpus, hosts, expected=True)
    run = walker.walk(entry)
    ops = list(walker.ops.values())
    flops = sum(o.flops for o in ops if o.kind in ("matmul", "conv"))
    return Estimate(gpu=t.key, gpus=gpus, hosts=hosts, examples=examples, seconds=run["seconds"],
                    lower_bound=max(low["roofline"], low["communication"], low["host_seconds"]),
                    roofline=low["roofline"], compute=run["compute"],
                    memory=run["memory"], launch=run["launch"], communication=run["communication"],
                    exposed=max(0.0, run["seconds"] - run["roofline"] - run["launch"] - run["host_wait"]), flops=flops,
                    peak_flops=walker.main_peak[1], ops=ops, to_host=run["to_host"], from_host=run["from_host"],
                    host_seconds=run["host_seconds"], host_wait=run["host_wait"],
                    model_flops=TRAIN_FACTOR * model_flops_per_example * examples / (gpus * hosts)
                    if model_flops_per_example else None)
