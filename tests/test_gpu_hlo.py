"""The compiled GPU program read as data (jaxtrain.analysis.hlo): no plugin needed, the HLO lines are XLA:GPU's."""

import pytest

from jaxtrain.analysis import hlo

CONV = ('  %cudnn-conv.1 = (bf16[128,9,9,50]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=5x5}, '
        'dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward", metadata={op_name="jit(step)/conv"}')
FILTER = ('  %cudnn-conv-bw-filter.3 = (bf16[50,5,5,20]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), window={size=5x5}, '
          'dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"')


def test_an_instruction_line_splits_into_shape_opcode_operands_and_attributes():
    i = hlo.parse_instr(CONV)
    assert (i.name, i.opcode, i.operands) == ("cudnn-conv.1", "custom-call", ["x", "w"])
    assert i.shape == "(bf16[128,9,9,50]{3,2,1,0}, u8[0]{0})" and i.attrs.startswith("window={size=5x5}")
    assert hlo.nbytes(i.shape) == 2 * 128 * 9 * 9 * 50
    fusion = hlo.parse_instr("  %f = f32[8]{0} fusion(%a, %b), kind=kLoop, calls=%fused_add")
    assert fusion.calls() == ["fused_add"] and hlo.parse_instr("not an instruction") is None


def test_convolution_flops_come_from_the_forward_shapes_whichever_direction():
    shapes = {"x": "bf16[128,13,13,20]{3,2,1,0}", "w": "bf16[50,5,5,20]{3,2,1,0}",
              "dy": "bf16[128,9,9,50]{3,2,1,0}"}
    forward = 2 * 128 * 9 * 9 * 50 * 5 * 5 * 20  # 2 x outputs x (kernel window x input features)
    assert hlo.conv_flops(hlo.parse_instr(CONV), shapes) == forward
    assert hlo.conv_flops(hlo.parse_instr(FILTER), shapes) == forward


def test_a_dot_counts_its_contracted_dimensions():
    dot = hlo.parse_instr("  %d = f32[8,128,128]{2,1,0} dot(%a, %b), lhs_batch_dims={1}, lhs_contracting_dims={2}, "
                          "rhs_batch_dims={0}, rhs_contracting_dims={1}")
    assert hlo.dot_flops(dot, {"a": "bf16[128,8,104]{2,1,0}"}) == 2 * 8 * 128 * 128 * 104


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['data'=2,'model'=4] {'model'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['data'=2,'model'=4] {'data'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups={}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("channel_id=1", [[0, 1, 2, 3, 4, 5, 6, 7]]),
])
def test_replica_groups_are_read_from_every_form_xla_prints(attrs, groups):
    assert hlo.replica_groups(attrs, 8) == groups
