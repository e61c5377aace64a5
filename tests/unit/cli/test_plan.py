"""``splitserve plan``'s refusals before it touches a cluster: each names what is wrong."""

from __future__ import annotations

import pytest

from cli.main import main


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--token-file", "{tmp}/no-such-token"], "no-such-token"),
        (["--tls-ca", "{tmp}/no-such-ca.pem"], "no-such-ca.pem"),
        (["--ttft-slo-s", "0"], "ttft_slo_s"),
    ],
)
def test_a_bad_flag_exits_2_naming_it(tmp_path, capsys, flags, named):
    argv = ["plan", "--addr", "127.0.0.1:1", "--connector", "kubernetes"] + [f.format(tmp=tmp_path) for f in flags]
    assert main(argv) == 2
    assert named in capsys.readouterr().err
