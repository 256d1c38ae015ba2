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


def test_the_tree_follows_the_indentation():
    top = thunks.parse(STEPS)
    assert [t.kind for t in top] == ["kCustomKernel", "kCustomKernel", "kCopy", "kWhile", "kCustomKernel"]
    loop = top[3]
    assert [t.kind for t in loop.children] == ["kCustomKernel", "kAsyncStart", "kAsyncDone", "kConvolution",
                                               "kCommandBuffer"]
    assert [t.kind for t in loop.children[1].children[0].children] == ["kCopy"]
    assert len(loop.children[4].children) == 2


def test_a_command_buffer_is_one_launch_and_a_loop_on_the_host_is_launched_a_trip_at_a_time():
    assert thunks.summary(thunks.parse(STEPS)) == {
        "command_buffers": 1, "captured": 2,
        "host_launches": 3 + 5 + 1,  # before the loop, the loop once (compare, copy, done, conv, buffer), after
        "loops": 1, "loops_captured": 0, "first_loop_trip": 5}


def test_a_captured_loop_leaves_the_host_one_launch():
    assert thunks.summary(thunks.parse(CAPTURED)) == {
        "command_buffers": 1, "captured": 3, "host_launches": 1, "loops": 1, "loops_captured": 1,
        "first_loop_trip": 0}


def test_no_loop_no_trip():
    assert thunks.summary(thunks.parse(STEPS.splitlines()[0]))["first_loop_trip"] is None
