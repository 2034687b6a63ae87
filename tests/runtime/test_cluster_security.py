"""Joining a cluster: TLS files are checked before any connection, and the local
dashboard only ever binds to the loopback interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.errors import ClusterError
from flowrl.runtime.cluster import Cluster


def test_a_missing_tls_file_is_named_before_connecting(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"runtime.tls_cert: .*nope.pem.*existing PEM file"):
        Cluster.join("tls://127.0.0.1:1", timeout_s=1, tls={"ca_file": None, "cert": str(tmp_path / "nope.pem"), "key": None})


def test_yaml_tags_that_build_objects_are_refused(tmp_path: Path) -> None:
    from flowrl.errors import FlowrlError
    from flowrl.spec.loader import load_pipeline

    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(FlowrlError) as caught:
        load_pipeline(path)
    assert "evil.yaml" in str(caught.value)


def test_tls_files_are_found_next_to_the_pipeline_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrl.spec.loader import pipeline_file

    (tmp_path / "project" / "certs").mkdir(parents=True)
    (tmp_path / "project" / "certs" / "ca.pem").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert pipeline_file("certs/ca.pem", tmp_path / "project") == str(tmp_path / "project" / "certs" / "ca.pem")
    assert pipeline_file("other.pem", tmp_path / "project") == "other.pem"  # as given: the working directory
    assert pipeline_file(None, tmp_path / "project") is None
