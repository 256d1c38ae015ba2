"""jaxtrain.gpu.thunks: a compiled GPU program's thunks read from XLA's dump, what command buffers hold and what the
host launches (the compiles themselves are tests/test_gpu_compile.py's: they need the gpu-compile extra)."""

from jaxtrain.gpu import thunks

# As XLA (jaxlib 0.12.0.1) writes a K-step call's thunk sequence after its thunk passes, shortened: two kernels and
# a copy before the steps' loop; in its body an async slice (a copy inside), a convolution and a command buffer of
# two kernels.
STEPS = """\
001: kCustomKernel [source       | next=005 (4)] loop_broadcast_fusion grid: [1, 1, 1] threads: [8, 1, 1]
002: kCustomKernel [source       | next=005 (3)] wrapped_transpose grid: [2, 1, 1] threads: [128, 1, 1]
004: kCopy         [source       | next=005 (1)] kCopy
005: kWhile        [prev=004 (1) | next=049 (1)]
condition:
    006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    007: kAsyncStart    [source       | next=011 (2)] stream=computation_stream[0], async_id=7
        009: kDynamicSliceFusion [source | sink] params=1, results=1
            008: kCopy [source | sink] kCopy
    010: kAsyncDone     [source       | sink        ] async_id=7
    011: kConvolution   [prev=007 (2) | next=012 (1)] kConvolution
    000: kCommandBuffer [prev=011 (1) | next=025 (1)]
        014: kCustomKernel [source       | next=015 (1)] loop_reduce_fusion grid: [1600, 1, 1] threads: [128, 1, 1]
        015: kCustomKernel [prev=014 (1) | sink        ] gemm_fusion_dot_8 grid: [2048, 1, 1] threads: [64, 1, 1]
049: kCustomKernel [prev=005 (1) | sink] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]
"""

# A loop of kernels only, with while bodies allowed in command buffers: the whole program is one.
CAPTURED = """\
000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=003 (2)] kCopy
    003: kWhile [prev=002 (1) | sink        ]
condition:
        004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
      body:
        005: kCustomKernel [source       | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]
"""


# What XLA writes beside it: each thunk's HLO name, and the loop's known trip count in the optimized HLO.
METADATA = """\
thunk_metadata {
  thunk_info {
    profile_annotation: "while.238"
    thunk_id: 5
  }
  thunk_kind: "kWhile"
}
"""
HLO = ('  %while.238 = (s32[], f32[64,64]{1,0}) while(%tuple.1), condition=%cond, body=%body, '
       'backend_config={"known_trip_count":{"n":"8"},"known_init_step":{"init":"0","step":"1"}}\n')


def test_the_tree_follows_the_indentation_and_the_loops_sections():
    top = thunks.parse(STEPS)
    assert [t.kind for t in top] == ["kCustomKernel", "kCustomKernel", "kCopy", "kWhile", "kCustomKernel"]
    loop = top[3]
    assert [(t.kind, t.section) for t in loop.children] == [
        ("kCustomKernel", "condition"), ("kAsyncStart", "body"), ("kAsyncDone", "body"), ("kConvolution", "body"),
        ("kCommandBuffer", "body")]
    assert [t.kind for t in loop.children[1].children[0].children] == ["kCopy"]
    assert len(loop.children[4].children) == 2 and loop.children[4].children[0].section is None
    assert top[4].section is None and loop.trips is None


def test_a_loops_known_trip_count_is_read_from_the_hlo_by_its_thunks_name():
    assert thunks.trip_counts(METADATA, HLO) == {5: 8}
    assert thunks.parse(STEPS, {5: 8})[3].trips == 8


def test_the_host_launches_a_known_loops_body_each_trip_and_never_its_condition():
    assert thunks.summary(thunks.parse(STEPS, {5: 8}), steps=8) == {
        "command_buffers": 1, "captured": 2,
        "host_launches": 3 + 8 * 4 + 1,  # before the loop; 8 trips of its body (copy, done, conv, buffer); after
        "loops": 1, "loops_captured": 0, "loops_of_unknown_trips": 0,
        "steps_loop_captured": False, "steps_loop_trip": 4}
    unknown = thunks.summary(thunks.parse(STEPS), steps=8)  # its condition and body once, and said so
    assert unknown["host_launches"] == 3 + 1 + 4 + 1 and unknown["loops_of_unknown_trips"] == 1


def test_a_captured_loop_leaves_the_host_one_launch():
    assert thunks.summary(thunks.parse(CAPTURED), steps=8) == {
        "command_buffers": 1, "captured": 3, "host_launches": 1, "loops": 1, "loops_captured": 1,
        "loops_of_unknown_trips": 1, "steps_loop_captured": True, "steps_loop_trip": 0}


def test_one_step_a_call_has_no_steps_loop_even_with_loops_inside():
    s = thunks.summary(thunks.parse(STEPS, {5: 2}), steps=1)  # e.g. a GPT's loop over its layers
    assert s["steps_loop_trip"] is None and s["steps_loop_captured"] is None and s["loops"] == 1


# As XLA (jaxlib 0.12.0.1) writes a conditional, shortened from a dump without command buffers: a loop of 8 trips
# whose body holds one, then another after it; each branch's thunks under its label.
CONDITIONALS = """\
001: kCopy         [source       | next=003 (2)] kCopy
003: kWhile        [prev=002 (1) | next=011 (1)]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    006: kCustomKernel [source       | next=010 (1)] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]
    010: kConditional  [prev=006 (1) | sink        ]
      false_branch:
        007: kCustomKernel [source       | next=008 (1)] gemm_fusion_dot_1 grid: [2048, 1, 1] threads: [64, 1, 1]
        008: kCustomKernel [prev=007 (1) | sink        ] loop_add_fusion grid: [512, 1, 1] threads: [128, 1, 1]
      true_branch:
        009: kCustomKernel [source | sink] loop_subtract_fusion grid: [512, 1, 1] threads: [128, 1, 1]
017: kConditional  [prev=013 (1) | sink        ]
  false_branch:
    014: kCustomKernel [source       | next=015 (1)] gemm_fusion_dot_2 grid: [4096, 1, 1] threads: [64, 1, 1]
  true_branch:
    016: kCustomKernel [source | sink] loop_multiply_fusion grid: [512, 1, 1] threads: [128, 1, 1]
    018: kCustomKernel [source | sink] loop_add_fusion_3 grid: [512, 1, 1] threads: [128, 1, 1]
"""


def test_a_conditional_launches_its_largest_branch():
    top = thunks.parse(CONDITIONALS, {3: 8})
    inner = top[1].children[2]
    assert [(t.id, t.section) for t in inner.children] == [(7, "false_branch"), (8, "false_branch"),
                                                           (9, "true_branch")]
    assert thunks.launches(top) == 1 + 8 * (1 + 2) + 2  # a copy; 8 trips of a kernel and 2 of 3; then 2 of 3


# Loops in a loop, as a GPT's K-step call has them (shortened): the steps' loop of 8 trips, and in its body a
# command buffer and two loops over the layers of 2 trips each, their labels at XLA's odd indentation.
NESTED = """\
003: kWhile        [prev=002 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    000: kCommandBuffer [source       | next=045 (1)]
        005: kCustomKernel [source       | next=006 (1)] wrapped_convert grid: [1, 1, 1] threads: [1, 1, 1]
        006: kCustomKernel [prev=005 (1) | sink        ] input_transpose_fusion grid: [1, 1, 1] threads: [1, 1, 1]
    045: kWhile         [prev=000 (1) | next=000 (1)]
condition:
        046: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]
      body:
        047: kAsyncStart    [source       | next=063 (8) ] stream=computation_stream[1], async_id=47
            049: kDynamicSliceFusion [source | sink] params=1, results=1
                048: kCopy [source | sink] kCopy
        050: kAsyncDone     [source       | sink        ] async_id=47
        051: kCuDnn         [source       | sink        ] kCuDnn
    147: kWhile         [prev=000 (1) | next=000 (1)]
condition:
        148: kCustomKernel [source | sink] loop_compare_fusion_2 grid: [1, 1, 1] threads: [1, 1, 1]
      body:
        151: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]
    160: kCustomKernel [source | sink] loop_multiply_fusion grid: [1, 1, 1] threads: [1, 1, 1]
"""


def test_loops_in_a_loop_are_launched_their_trips_each_trip_of_the_outer_one():
    top = thunks.parse(NESTED, {3: 8, 45: 2, 147: 2})
    outer = top[0]
    assert [(t.id, t.section) for t in outer.children] == [(4, "condition"), (0, "body"), (45, "body"),
                                                           (147, "body"), (160, "body")]
    assert [t.section for t in outer.children[2].children] == ["condition", "body", "body", "body"]
    s = thunks.summary(top, steps=8)
    trip = 1 + 2 * 3 + 2 * 1 + 1  # the command buffer; 2 trips of (copy, done, cuDNN); 2 trips of a kernel; a kernel
    assert (s["steps_loop_trip"], s["host_launches"], s["loops"]) == (trip, 8 * trip, 3)
    assert thunks.summary(top, steps=2)["steps_loop_trip"] == 3  # 2 steps a call: the first loop of 2 trips


def _child(monkeypatch, returncode=0, stderr=""):
    """thunks' child compile replaced: what it was started with, and its exit."""
    import subprocess

    seen = {}

    def run(cmd, env, **kw):
        seen["flags"] = env["XLA_FLAGS"]
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(thunks.subprocess, "run", run)
    return seen


def test_a_users_command_buffer_flag_is_left_out_of_each_modes_compile_saying_so(monkeypatch, caplog):
    import pytest

    from jaxtrain.errors import ConfigError

    seen = _child(monkeypatch)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_gpu_enable_command_buffer=FUSION")
    with pytest.raises(ConfigError, match="XLA wrote no thunk sequence"):  # the stand-in compiled nothing
        thunks.dumped(("--xla_gpu_enable_command_buffer=",), "pass")
    assert seen["flags"].startswith("--xla_foo=1 --xla_gpu_enable_command_buffer= --xla_dump_to=")
    assert [r.getMessage() for r in caplog.records] == [
        "left out of this compile: --xla_gpu_enable_command_buffer=FUSION from $XLA_FLAGS (each mode's own flag is "
        "compared)"]


def test_the_childs_refusal_is_its_own_line_and_a_crash_says_the_compile_failed(monkeypatch):
    import pytest

    from jaxtrain.errors import ConfigError

    _child(monkeypatch, 1, "Traceback ...\njaxtrain.errors.ConfigError: model='nosuch': not one of lenet, vit")
    with pytest.raises(ConfigError, match=r"^model='nosuch': not one of lenet, vit$"):
        thunks.dumped((), "pass")
    _child(monkeypatch, 1, "F1201 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_x")
    with pytest.raises(ConfigError, match=r"^compiling for the GPU failed: F1201 .*Unknown flag"):
        thunks.dumped((), "pass")


def test_modes_a_jaxlib_may_not_parse_are_refused_before_any_compile(monkeypatch):
    import pytest

    from jaxtrain.core import compat
    from jaxtrain.errors import ConfigError

    seen = _child(monkeypatch)
    monkeypatch.setattr(compat, "installed_version", lambda dist: (0, 13, 0))
    monkeypatch.setattr(compat, "installed_version_text", lambda dist: "0.13.0")
    with pytest.raises(ConfigError, match=r"^jaxlib 0.13.0 is not one whose .*: its off, loops would compile as xla"):
        thunks.command_buffers({"model": "lenet"}, 8)
    with pytest.raises(ConfigError, match="plan\\(\\) takes the settings"):
        thunks.command_buffers({"modle": "lenet"}, 8)
    assert not seen  # nothing compiled
