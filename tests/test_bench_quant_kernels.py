"""``pagellm bench quant-kernels``: every contender runs on the same weights and gives the
reference product (so torch's repacked forms are right), and the report has what it names."""

import json
import re

import pytest

from pagellm.cli import main
from pagellm.kernels.quant_linear import load_quant_linear_kernel


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if load_quant_linear_kernel() is None:
        pytest.skip("no C++ compiler")


def test_contenders_agree_with_the_reference_and_report(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = main(["bench", "quant-kernels", "--shapes", "48x128,32x96", "--rows", "1,9",
               "--layers", "2", "--rounds", "1", "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert [(c["format"], c["shape"], c["rows"]) for c in cases] == [
        (fmt, shape, rows)
        for fmt in ("int8", "int4")
        for shape in ([48, 128], [32, 96])
        for rows in (1, 9)
    ]
    for case in cases:
        assert set(case["ms"]) == {"pagellm", "pagellm_eager", "torch", "bf16"}
        assert all(ms > 0 for ms in case["ms"].values())
        # bf16 sums and (for few rows of int4) int8 activations: well under 3% of the largest
        # output; a wrongly repacked weight is off by its whole size
        assert all(err < 0.03 for err in case["max_rel_err"].values()), case
    printed = capsys.readouterr().out
    assert "CPU:" in printed and re.search(r"^int4\s+all\s+9\s", printed, re.MULTILINE)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--formats", "fp8", "unknown ['fp8']"), ("--shapes", "64x100", "multiple of 32"),
     ("--rows", "0", "at least 1")],
)  # fmt: skip
def test_bad_arguments_name_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "quant-kernels", flag, value])
    assert message in str(exc.value)
