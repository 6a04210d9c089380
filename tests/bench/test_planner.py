"""bench.planner: the carry and auto columns next to the HARTS plan, on a small step."""

from bench.planner import context_sizes, main
from models.presets import preset


def test_planner_bench_reports_carry(capsys):
    assert main(["--steps", "1", "--scale", "0.02", "--methods", "arbor,carry,auto"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("command: python -m bench.planner --steps 1")
    summary = out[out.index("Summary over all steps"):out.index("Carried context")]
    summary = {line.split()[0]: line.split() for line in summary.splitlines() if line.startswith(("arbor ", "carry "))}
    assert float(summary["carry"][2]) < float(summary["arbor"][2]), "carry executes fewer rows than the HARTS plan"
    assert "Carried context" in out


def test_context_sizes_of_ling_3_tiny():
    """6 MLA layers of a 512-wide bf16 latent and a 64-wide shared key, 18 KDA layers of 16 x 128 x 128 fp32 states."""
    sizes = context_sizes(preset("ling-3-tiny"))
    assert sizes.full_attention_row == 6 * (512 + 64) * 2
    assert sizes.linear_state == 18 * 16 * 128 * 128 * 4
    assert sizes.conv_row == 18 * 3 * 16 * 128 * 2 and sizes.chunk_size == 64 and sizes.conv_width == 4
