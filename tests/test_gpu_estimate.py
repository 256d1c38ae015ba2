"""The GPU step-time estimate (jaxtrain.gpu.estimate) on small hand-written XLA:GPU programs, in the form
``compiled.as_text()`` prints them: no CUDA plugin needed (tests/test_gpu_compile.py compiles real ones).

The expected numbers are worked out here by hand: peaks and bandwidths from NVIDIA's datasheets, collectives
from NCCL's cost model as its source states it (NVIDIA/nccl v2.7.5, src/graph/tuning.cc), not rebuilt from the
estimate's tables. Read from targets.json: only the two "_costs" constants a kernel's expected time adds (the
fitted efficiency, the launch cost). Read from the estimate: only, in the overlap test, an all-reduce's own time,
whose formula the collective test checks.
"""

import pytest

from jaxtrain.gpu.estimate import estimate
from jaxtrain.gpu.targets import costs

EFFICIENCY, LAUNCH = costs().efficiency, costs().launch_us * 1e-6
HBM = 3.35e12  # H100 SXM5 datasheet: 3.35 TB/s of HBM3
NVLINK = 450e9  # H100 NVLink: 900 GB/s both ways, 450 each way
NETWORK = 50e9  # DGX H100: one 400 Gb/s ConnectX-7 port per GPU
ADD = """%region_0.1 (Arg_0.2: f32[], Arg_1.3: f32[]) -> f32[] {
  %Arg_0.2 = f32[] parameter(0)
  %Arg_1.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(f32[] %Arg_0.2, f32[] %Arg_1.3)
}
"""


def _kernel(seconds_of_bytes: float) -> float:
    """A kernel's expected time from its roofline: over the fitted efficiency, plus one launch."""
    return seconds_of_bytes / EFFICIENCY + LAUNCH


def _double(name: str, n: int) -> str:
    """A kLoop fusion's computation, ``x * 2`` over f32[n]: its kernel reads 4n bytes and writes 4n."""
    return (f"%{name} (param_0.{name}: f32[{n}]) -> f32[{n}] {{\n"
            f"  %param_0.{name} = f32[{n}]{{0}} parameter(0)\n"
            f"  %constant.{name} = f32[] constant(2)\n"
            f"  %broadcast.{name} = f32[{n}]{{0}} broadcast(f32[] %constant.{name}), dimensions={{}}\n"
            f"  ROOT %multiply.{name} = f32[{n}]{{0}} multiply(f32[{n}]{{0}} %param_0.{name}, "
            f"f32[{n}]{{0}} %broadcast.{name})\n}}\n")


def _matmul(dtype: str, n: int, precision: str, cublas: bool) -> str:
    """``a @ b`` of two [n, n] arrays at ``precision`` (jax.lax.Precision's name), as XLA:GPU prints it: a Triton
    gemm fusion (HIGHEST as the dot's ``operand_precision``) or a cuBLAS call (in its backend_config)."""
    s = f"{dtype}[{n},{n}]{{1,0}}"
    args = f"({s} %Arg_0.1, {s} %Arg_1.2)"
    fused = ""
    if cublas:
        call = (f'  %custom-call.1 = ({s}, s8[4194304]{{0}}) custom-call{args}, custom_call_target="__cublas$gemm", '
                'backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{'
                '"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
                '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
                f'"alpha_imag":0,"precision_config":{{"operand_precision":["{precision}","{precision}"],'
                '"algorithm":"ALG_UNSET"},"epilogue":"DEFAULT"},"force_earliest_schedule":false}\n'
                f"  ROOT %get-tuple-element.1 = {s} get-tuple-element(({s}, s8[4194304]{{0}}) %custom-call.1), "
                "index=0")
    else:
        highest = ", operand_precision={highest,highest}" if precision == "HIGHEST" else ""
        fused = (f"%gemm_fusion_dot.1_computation (parameter_0: {s[:-5]}, parameter_1: {s[:-5]}) -> {s[:-5]} {{\n"
                 f"  %parameter_0 = {s} parameter(0)\n  %parameter_1 = {s} parameter(1)\n"
                 f"  ROOT %dot.1 = {s} dot({s} %parameter_0, {s} %parameter_1), lhs_contracting_dims={{1}}, "
                 f'rhs_contracting_dims={{0}}{highest}, metadata={{op_name="jit(matmul)/dot_general"}}\n}}\n\n')
        call = (f"  ROOT %gemm_fusion_dot.1 = {s} fusion{args}, kind=kCustom, calls=%gemm_fusion_dot.1_computation, "
                'backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{'
                '"kind":"__triton_gemm","triton_gemm_config":{"block_m":"128","block_n":"128","block_k":"32",'
                '"split_k":"1","num_stages":"3","num_warps":"4","num_ctas":"1"}},"force_earliest_schedule":false}')
    return (f"HloModule jit_matmul, is_scheduled=true\n\n{fused}"
            f"ENTRY %main.4 (Arg_0.1: {s[:-5]}, Arg_1.2: {s[:-5]}) -> {s[:-5]} {{\n"
            f"  %Arg_0.1 = {s} parameter(0)\n  %Arg_1.2 = {s} parameter(1)\n{call}\n}}\n")


@pytest.mark.parametrize("gpu, dtype, precision, cublas, peak", [
    ("h100", "f32", "DEFAULT", False, 494.5e12),  # TF32 tensor cores: the datasheet's 989 "with sparsity", halved
    ("h100", "f32", "DEFAULT", True, 494.5e12),
    ("a100", "f32", "DEFAULT", True, 156e12),  # A100 TF32 (312 with sparsity)
    ("h100", "f32", "HIGHEST", False, 67e12),  # full fp32 on the CUDA cores
    ("h100", "f32", "HIGHEST", True, 67e12),
    ("h100", "bf16", "DEFAULT", False, 989.5e12),
    ("v100", "f32", "DEFAULT", False, 15.7e12),  # Volta has no TF32 tensor cores
])
def test_a_matmul_runs_at_the_dense_peak_its_dtype_and_precision_get(gpu, dtype, precision, cublas, peak):
    """Guards the peak a matmul is timed at. XLA runs f32 dots as TF32 on tensor cores on A100 and H100 by
    default (7.4x the plain fp32 peak on an H100), and at the fp32 peak only at Precision.HIGHEST, which a Triton
    gemm's dot and a cuBLAS call print differently. 2 x 4096^3 FLOPs outweigh 3 x 4096^2 elements at HBM speed
    at every one of these peaks: the time is the FLOPs at the peak."""
    n = 4096
    e = estimate(_matmul(dtype, n, precision, cublas), gpu, 1, 1, 1)
    assert e.flops == 2 * n**3 and e.peak_flops == pytest.approx(peak, rel=1e-12)
    assert e.bottleneck == "compute" and e.costliest(1)[0].kind == "matmul"
    assert e.lower_bound == pytest.approx(2 * n**3 / peak, rel=1e-9)
    assert e.seconds == pytest.approx(_kernel(2 * n**3 / peak), rel=1e-9)


def test_a_memory_bound_kernel_takes_its_bytes_at_hbm_speed_over_the_efficiency():
    """Guards the fitted efficiency's place: it divides a memory-bound kernel's time as it does a compute-bound
    one's (it was fitted on a memory-bound program, docs/gpu-estimate.md); the lower bound has neither it nor
    the launch. ``x * 2`` on 64 MiB of f32 reads and writes 64 MiB each: 40 us at 3.35 TB/s."""
    n = 2**24
    text = (f"HloModule jit_double, is_scheduled=true\n\n{_double('fused_multiply', n)}\n"
            f"ENTRY %main.3 (Arg_0.1: f32[{n}]) -> f32[{n}] {{\n  %Arg_0.1 = f32[{n}]{{0}} parameter(0)\n"
            f"  ROOT %loop_multiply_fusion = f32[{n}]{{0}} fusion(f32[{n}]{{0}} %Arg_0.1), kind=kLoop, "
            'calls=%fused_multiply, metadata={op_name="jit(double)/mul"}\n}\n')
    e = estimate(text, "h100", 1, 1, 1)
    moved = 2 * 4 * n
    assert e.flops == 0 and e.bottleneck == "memory" and e.compute == 0
    assert e.lower_bound == pytest.approx(moved / HBM, rel=1e-9)
    assert e.memory == pytest.approx(moved / HBM / EFFICIENCY, rel=1e-9)
    assert e.seconds == pytest.approx(_kernel(moved / HBM), rel=1e-9)


def _collective(kind: str, elements: int, groups: str) -> str:
    """One synchronous collective of f32 (``elements``: its result's; an all-gather's operand is 1/8 of it)."""
    operand = elements // 8 if kind == "all-gather" else elements
    extra = ", dimensions={0}" if kind == "all-gather" else ", to_apply=%region_0.1"
    return (f"HloModule jit_collective, is_scheduled=true\n\n{ADD}\n"
            f"ENTRY %main.6 (Arg_0.1: f32[{operand}]) -> f32[{elements}] {{\n"
            f"  %Arg_0.1 = f32[{operand}]{{0}} parameter(0)\n"
            f"  ROOT %{kind}.5 = f32[{elements}]{{0}} {kind}(f32[{operand}]{{0}} %Arg_0.1), channel_id=1, "
            f"replica_groups={groups}, use_global_device_ids=true{extra}\n}}\n")


# NCCL v2.7.5, src/graph/tuning.cc: a collective takes latency + bytes / bandwidth, NCCL picking the fastest
# algorithm and protocol. Latency in us: a base (ring LL 3.6, Simple 8.4; tree LL 4.4, Simple 0) plus, per step,
# an NVLink hop (ring LL .47, Simple 3.4; tree LL .52, Simple 28) or a network hop (ring LL 2.7, Simple 9.6; tree
# LL 5.0, Simple 50). A ring all-reduce takes 2(n-1) steps, 2(hosts-1) of them across hosts (all-gather: n-1 and
# hosts-1) and moves 2(n-1)/n of the bytes ((n-1)/n) at the bus bandwidth, LL at 1/4 of it; a tree takes
# 2((n/hosts-1) NVLink + log2(hosts) network) hops and moves the bytes at half of 0.9 x the bus bandwidth capped
# at 110 GB/s (80 beyond 2 hosts), LL at 1/3.8 of that. The bus: NVLink within a host, the network across hosts.
# The formula the estimate states (targets.json "protocols_source"): NCCL's finer corrections, which it leaves out
# (LL's NVLink hops x 1.8 across hosts, the ring Simple plateau x 1.9, the tree's factors per size), are left out.
@pytest.mark.parametrize("kind, elements, groups, gpus, hosts, expected", [
    # 64 MiB, 8 GPUs on 2 hosts: ring Simple, 12 NVLink + 2 network steps, 2 x 7/8 of the bytes at 50 GB/s (2.42 ms;
    # LL: 9.4 ms, tree Simple: 268 us + 2^26 B at 22.5 GB/s = 3.25 ms).
    ("all-reduce", 2**24, "[1,8]<=[8]", 4, 2, (8.4 + 12 * 3.4 + 2 * 9.6) * 1e-6 + 2 * 7 / 8 * 2**26 / NETWORK),
    # 4 KiB, the same GPUs: latency-bound, ring LL (15.2 us; tree LL: 4.4 + 2 x (3 x .52 + 5.0) + 0.7 = 18.2 us).
    ("all-reduce", 2**10, "[1,8]<=[8]", 4, 2, (3.6 + 12 * .47 + 2 * 2.7) * 1e-6 + 2 * 7 / 8 * 2**12 / (NETWORK / 4)),
    # 4 KiB, 32 GPUs on 4 hosts: tree LL, 2 x (7 NVLink + 2 network) hops (32.4 us; ring LL: 3.6 + 56 x .47 + 6 x 2.7
    # + 0.6 = 46.8 us).
    ("all-reduce", 2**10, "[1,32]<=[32]", 8, 4,
     (4.4 + 2 * (7 * .52 + 2 * 5.0)) * 1e-6 + 2**12 / (0.5 * min(0.9 * NETWORK, 80e9) / 3.8)),
    # 32 KiB gathered by 8 GPUs on 2 hosts: ring LL, 6 NVLink steps and 1 network step, 7/8 of the bytes.
    ("all-gather", 2**13, "[1,8]<=[8]", 4, 2, (3.6 + 6 * .47 + 1 * 2.7) * 1e-6 + 7 / 8 * 2**15 / (NETWORK / 4)),
    # Groups of 4 within each host ({0..3}, {4..7}): NVLink only, ring LL 6 steps (6.5 us; tree LL 7.8 us).
    ("all-reduce", 2**10, "[2,4]<=[8]", 4, 2, (3.6 + 6 * .47) * 1e-6 + 2 * 3 / 4 * 2**12 / (NVLINK / 4)),
    # Pairs across the hosts ({0,4}, {1,5}...): both ring steps cross the network (9.3 us; tree LL 15.1 us).
    ("all-reduce", 2**10, "[4,2]<=[2,4]T(1,0)", 4, 2, (3.6 + 2 * 2.7) * 1e-6 + 2 * 1 / 2 * 2**12 / (NETWORK / 4)),
])
def test_a_collective_takes_nccls_time_on_the_links_its_groups_span(kind, elements, groups, gpus, hosts, expected):
    """Guards the collectives' model across hosts: which steps of a ring cross the network, the tree's hops
    (log2 of the hosts), the bytes a ring moves, and NCCL's choice among ring and tree, LL and Simple, each
    evaluated by hand above from NCCL's published formula and constants with H100 / DGX H100 link figures.
    (targets.json rounds LL's 1/3.8 to 0.2632: 3e-6 of the tree's 32 us, inside the tolerance.)"""
    e = estimate(_collective(kind, elements, groups), "h100", gpus, hosts, 1)
    assert [(o.kind, o.bytes) for o in e.ops] == [(kind, 4 * elements)]
    assert e.communication == pytest.approx(expected, rel=1e-5)
    assert e.seconds == pytest.approx(expected, rel=1e-5)  # synchronous, and nothing else to do


def _overlap(synchronous: bool, between: int) -> str:
    """An async all-reduce of 16 MiB over 8 GPUs (NVLink) with ``x * 2`` on f32[between] scheduled between its
    start and its done, and ``x * 2`` on f32[2^20] after the done."""
    g, after = 2**22, 2**20
    config = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":'
              f'{{"is_sync":{str(synchronous).lower()},"no_parallel_custom_call":false}},'
              '"force_earliest_schedule":false}')
    return (f"HloModule jit_step, is_scheduled=true\n\n{ADD}\n{_double('fused_multiply', between)}\n"
            f"{_double('fused_multiply.1', after)}\n"
            f"ENTRY %main.9 (Arg_0.1: f32[{g}], Arg_1.2: f32[{between}], Arg_2.3: f32[{after}]) -> "
            f"(f32[{g}], f32[{between}], f32[{after}]) {{\n"
            f"  %Arg_0.1 = f32[{g}]{{0}} parameter(0)\n  %Arg_1.2 = f32[{between}]{{0}} parameter(1)\n"
            f"  %Arg_2.3 = f32[{after}]{{0}} parameter(2)\n"
            f"  %all-reduce-start = f32[{g}]{{0}} all-reduce-start(f32[{g}]{{0}} %Arg_0.1), channel_id=1, "
            f"replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%region_0.1, {config}\n"
            f"  %loop_multiply_fusion = f32[{between}]{{0}} fusion(f32[{between}]{{0}} %Arg_1.2), kind=kLoop, "
            "calls=%fused_multiply\n"
            f"  %all-reduce-done = f32[{g}]{{0}} all-reduce-done(f32[{g}]{{0}} %all-reduce-start)\n"
            f"  %loop_multiply_fusion.1 = f32[{after}]{{0}} fusion(f32[{after}]{{0}} %Arg_2.3), kind=kLoop, "
            "calls=%fused_multiply.1\n"
            f"  ROOT %tuple.8 = (f32[{g}]{{0}}, f32[{between}]{{0}}, f32[{after}]{{0}}) tuple(f32[{g}]{{0}} "
            f"%all-reduce-done, f32[{between}]{{0}} %loop_multiply_fusion, f32[{after}]{{0}} %loop_multiply_fusion.1)"
            "\n}\n")


@pytest.mark.parametrize("between", [2**20, 2**26])  # 5 us of compute under a ~120 us all-reduce; 259 us
def test_an_async_collective_exposes_only_what_the_compute_between_its_start_and_done_does_not_hide(between):
    """Guards the overlap of async collectives: the compute stream runs the kernels XLA scheduled between an
    all-reduce-start and its -done while the transfer runs, waits at the -done for what is left of it, then
    runs what follows. The same program marked is_sync (as XLA marks the collectives it keeps synchronous)
    runs them one after the other. The all-reduce's own time is the sync program's (its formula is tested
    above); the kernels' are worked out here."""
    sync, overlapped = (estimate(_overlap(s, between), "h100", 8, 1, 1) for s in (True, False))
    comm = sync.communication
    first, last = _kernel(8 * between / HBM), _kernel(8 * 2**20 / HBM)
    assert overlapped.communication == comm and (comm > first) == (between == 2**20)  # both cases are covered
    assert sync.seconds == pytest.approx(first + comm + last, rel=1e-9)
    assert sync.exposed == pytest.approx(comm, rel=1e-6)
    assert overlapped.seconds == pytest.approx(max(first, comm) + last, rel=1e-9)
    assert overlapped.exposed == pytest.approx(max(0.0, comm - first), rel=1e-6, abs=1e-12)


def test_a_while_loop_counts_its_body_its_known_trip_count_times():
    """Guards loops (a scan over layers or micro-batches): XLA prints the trip count it proved in the while's
    backend_config (known_trip_count); its body runs that many times, here 10 x (``x * 2`` on 16 MiB + the
    counter's increment, a kernel of 3 s32 values), each with its launch."""
    n, trips = 2**22, 10
    loop = f"(s32[], f32[{n}]{{0}})"
    text = (f"HloModule jit_scan, is_scheduled=true\n\n{_double('fused_multiply', n)}\n"
            f"%body.1 (param.1: (s32[], f32[{n}])) -> (s32[], f32[{n}]) {{\n  %param.1 = {loop} parameter(0)\n"
            f"  %get-tuple-element.1 = s32[] get-tuple-element({loop} %param.1), index=0\n"
            f"  %get-tuple-element.2 = f32[{n}]{{0}} get-tuple-element({loop} %param.1), index=1\n"
            "  %constant.1 = s32[] constant(1)\n"
            "  %add.1 = s32[] add(s32[] %get-tuple-element.1, s32[] %constant.1)\n"
            f"  %loop_multiply_fusion = f32[{n}]{{0}} fusion(f32[{n}]{{0}} %get-tuple-element.2), kind=kLoop, "
            "calls=%fused_multiply\n"
            f"  ROOT %tuple.1 = {loop} tuple(s32[] %add.1, f32[{n}]{{0}} %loop_multiply_fusion)\n}}\n\n"
            f"%cond.1 (param.2: (s32[], f32[{n}])) -> pred[] {{\n  %param.2 = {loop} parameter(0)\n"
            f"  %get-tuple-element.3 = s32[] get-tuple-element({loop} %param.2), index=0\n"
            f"  %constant.2 = s32[] constant({trips})\n"
            "  ROOT %compare.1 = pred[] compare(s32[] %get-tuple-element.3, s32[] %constant.2), direction=LT\n}\n\n"
            f"ENTRY %main.5 (Arg_0.1: f32[{n}]) -> f32[{n}] {{\n  %Arg_0.1 = f32[{n}]{{0}} parameter(0)\n"
            "  %constant.3 = s32[] constant(0)\n"
            f"  %tuple.2 = {loop} tuple(s32[] %constant.3, f32[{n}]{{0}} %Arg_0.1)\n"
            f"  %while.1 = {loop} while({loop} %tuple.2), condition=%cond.1, body=%body.1, "
            f'backend_config={{"known_trip_count":{{"n":"{trips}"}},"known_init_step":{{"init":"0","step":"1"}},'
            '"known_induction_variable":{"tuple_index":"0"}}\n'
            f"  ROOT %get-tuple-element.4 = f32[{n}]{{0}} get-tuple-element({loop} %while.1), index=1\n}}\n")
    e = estimate(text, "h100", 1, 1, 1)
    double, increment = 8 * n, 3 * 4  # bytes: read and write 16 MiB; read 2 s32, write 1
    assert {o.name: o.count for o in e.ops} == {"loop_multiply_fusion": trips, "add.1": trips}
    assert e.lower_bound == pytest.approx(trips * (double + increment) / HBM, rel=1e-9)
    assert e.launch == pytest.approx(trips * 2 * LAUNCH, rel=1e-9)
    assert e.seconds == pytest.approx(trips * (_kernel(double / HBM) + _kernel(increment / HBM)), rel=1e-9)
