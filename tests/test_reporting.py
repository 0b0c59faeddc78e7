import math

import pytest

from fedbed.reporting import format_spread, mean_std_se, ood_table, paired_pairs, paired_t_test


def test_std_and_se_by_hand():
    # values 1, 2, 3, 6: mean 3; squared deviations 4+1+0+9 = 14; std = sqrt(14/3); SE = std/2
    mean, std, se = mean_std_se([1, 2, 3, 6])
    assert mean == 3 and std == pytest.approx(math.sqrt(14 / 3)) and se == pytest.approx(math.sqrt(14 / 3) / 2)
    assert format_spread([1, 2, 3, 6], "std") == "3.0 ± 2.2" and format_spread([1, 2, 3, 6], "se") == "3.0 ± 1.1"
    assert format_spread([5.0]) == "5.0"


def test_paired_t_test_known_case():
    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1/sqrt 3) = 2 sqrt 3; two-sided p with 2 df = 0.0742
    t, p = paired_t_test([2, 4, 6], [1, 2, 3])
    assert t == pytest.approx(2 * math.sqrt(3)) and p == pytest.approx(0.07418, abs=1e-4)
    with pytest.raises(ValueError):
        paired_t_test([1], [2])


def summary(algorithm, target, seed, ood):
    return {"algorithm": algorithm, "target": target, "seed": seed, "selection": {"last": {"ood_mean": ood}}}


def test_table_and_pairing():
    runs = [summary("a", "t1", 0, 10), summary("a", "t1", 1, 20), summary("a", "t2", 0, 30), summary("b", "t1", 0, 5), summary("b", "t2", 0, 7)]
    table = ood_table(runs, ["a", "b"], ["t1", "t2"], "last")
    assert "| a | 15.0 ± 7.1 | 30.0 | 22.5 |" in table and "± std over seeds" in table
    assert paired_pairs(runs, "a", "b", "last") == ([10, 30], [5, 7])
