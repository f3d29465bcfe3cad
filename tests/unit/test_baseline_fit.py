"""The conventional baseline's estimate (`longstraw demo`, ds_longstraw/tools/cli.py): a least-squares fit of runs
measured at small prompts, time constant + linear + quadratic in the prompt length, peak constant + linear.

  - synthetic measurements from known coefficients give those coefficients back (float64);
  - a term whose least-squares value would be negative is held at 0 (a cost has no negative term), and the
    others are the best fit without it;
  - fewer than three distinct lengths, or a figure missing for a length, raise ValueError naming the problem;
  - against the tiny model: a fit of measured conventional steps at 512, 1,024 and 2,048 tokens predicts the
    measured 4,096-token step (fresh processes, as the demo measures).
"""

import pytest

from ds_longstraw.tools.cli import fit_conventional, fit_polynomial, polynomial_at

LENGTHS = (1024, 2048, 4096)
# seconds: 0.35 s + 0.3 ms per token + 60 ns per token^2 (attention); peak: 110 MiB + 0.12 MiB per token
TIME = (0.35, 3.0e-4, 6.0e-8)
PEAK = (110 * 2**20, 0.12 * 2**20)
# The fit solves a 3x3 system scaled to lengths in [0, 1] (condition number ~1e2): float64 rounding leaves
# ~1e-14 relative; 1e-12 allows that and nothing else (a wrong power or scale errs by O(1)).
REL = 1e-12


def _figures(coefficients, lengths):
    return [polynomial_at(coefficients, n) for n in lengths]


@pytest.mark.parametrize("lengths", [LENGTHS, (1000, 3000, 5000, 7777)], ids=["1K-2K-4K", "four-uneven"])
def test_recovers_known_coefficients(lengths):
    fit = fit_conventional(lengths, _figures(TIME, lengths), _figures(PEAK, lengths))
    assert fit["seconds"] == pytest.approx(TIME, rel=REL)
    assert fit["peak_bytes"] == pytest.approx(PEAK, rel=REL)
    assert polynomial_at(fit["seconds"], 262144) == pytest.approx(polynomial_at(TIME, 262144), rel=REL)
    assert fit["describe"] == f"fit of {len(lengths)} measured lengths, constant + linear + quadratic"


def test_a_negative_term_is_held_at_zero():
    """Times that bend down (noise in small runs) would give a negative quadratic term, a negative time 64x
    further out; the fit keeps it at 0 and fits the rest: here the constant + linear line through the points."""
    xs, ys = (1, 2, 3), (1.0, 2.5, 3.0)  # unconstrained: -1.5 + 3 x - 0.5 x^2 through all three
    constant, linear, quadratic = fit_polynomial(xs, ys, 2)
    assert quadratic == 0.0
    # the least-squares line 1/6 + x (linear + quadratic alone fits closer, but only with a negative x^2 term)
    assert (constant, linear) == pytest.approx((1 / 6, 1.0), rel=REL)
    assert polynomial_at((constant, linear, quadratic), 4096) > 0


@pytest.mark.parametrize("lengths", [(2048, 4096), (4096,), (1024, 2048, 2048)],
                         ids=["two", "one", "two-distinct"])
def test_fewer_than_three_lengths_are_refused(lengths):
    with pytest.raises(ValueError, match=r"at least 3 distinct measured prompt lengths"):
        fit_conventional(lengths, _figures(TIME, lengths), _figures(PEAK, lengths))


def test_a_missing_figure_is_refused():
    with pytest.raises(ValueError, match=r"one time and one peak per measured length: 3 lengths, 2 times"):
        fit_conventional(LENGTHS, _figures(TIME, LENGTHS)[:2], _figures(PEAK, LENGTHS))


def test_predicts_a_measured_step_of_the_tiny_model():
    """Fit at 512, 1,024 and 2,048 prompt tokens, predict 4,096 (2x past the longest run, as the demo's 1K-2K-4K
    fit is used 16x and more past its own): each run in a fresh process, G = 2, responses of 64 tokens."""
    from ds_longstraw.tools.bench import run_fresh

    rows = {n: run_fresh("conventional", n, 2, 64, shape="small") for n in (512, 1024, 2048, 4096)}
    lengths = (512, 1024, 2048)
    # CPU seconds, not wall: the suite runs one intra-op thread (conftest.py), so CPU time is the step's work
    # whatever else this machine runs; the demo fits wall time on a machine it has to itself.
    fit = fit_conventional(lengths, [rows[n]["cpu_seconds"] for n in lengths],
                           [rows[n]["step_peak_bytes"] for n in lengths])
    # Time within a factor of 1.6: the quadratic term comes from three runs a few percent noisy each, and the
    # noise bends it; over this 2x step the prediction was measured 20-45% high on a 2-core machine.
    assert 1 / 1.6 < polynomial_at(fit["seconds"], 4096) / rows[4096]["cpu_seconds"] < 1.6
    # Peak within 10%: the peak is a resident-set high-water mark (allocator chunks, pages), linear in the prompt;
    # the prediction was measured 2-4% high.
    assert polynomial_at(fit["peak_bytes"], 4096) == pytest.approx(rows[4096]["step_peak_bytes"], rel=0.10)
