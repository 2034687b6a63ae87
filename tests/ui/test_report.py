"""``flowrl report`` built from a real run's output folder: the pictures, the trace that
matches profile.jsonl, and the page opened in a real headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import pytest

from flowrl.api.run import run
from flowrl.errors import FlowrlError
from flowrl.spec.loader import load_pipeline
from flowrl.ui.report import build_report, chosen_step

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "grpo_tiny.yaml"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-step run of the default pipeline with held-out evaluation every 3 steps."""
    folder = tmp_path_factory.mktemp("run")
    held_out = folder / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"Write digits: {n}"}) + "\n" for n in range(8)))
    output = folder / "out"
    graph = load_pipeline(PIPELINE, ["trainer.steps=6", "eval.every_steps=3", f"eval.source={held_out}"])
    run(graph, output_dir=output)
    return output


def test_the_report_draws_the_run_and_its_trace_is_profile_jsonl(run_folder: Path) -> None:
    from matplotlib import image

    page = build_report(run_folder)
    out = page.parent
    assert out == run_folder / "report"
    text = page.read_text()
    pictures = ["curves.png", "eval.png", "timeline.png", "nodes.png", "devices.png"]
    for name in pictures:
        pixels = image.imread(out / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 300, name
        # the page holds the same picture inside it
        assert base64.b64encode((out / name).read_bytes()).decode() in text, name
    assert text.count("<img ") == len(pictures)

    calls = [json.loads(line) for line in (run_folder / "profile.jsonl").read_text().splitlines()]
    calls = [call for call in calls if call["type"] == "node" and call["arrived_at"] > 0]
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    slices = [event for event in trace if event["ph"] == "X" and event["cat"] != "wait"]
    waits = [event for event in trace if event["ph"] == "X" and event["cat"] == "wait"]
    assert len(slices) == len(calls) and len(waits) == sum(1 for call in calls if call["wait_s"] > 0)
    lanes = {event["args"]["name"] for event in trace if event["ph"] == "M"}
    assert lanes == {call["device"] for call in calls}
    for event, call in zip(slices, calls):
        assert event["name"] == call["node"] and event["dur"] == pytest.approx(call["compute_s"] * 1e6)
        assert event["args"]["step"] == call["step"]
    # the drawn step is a typical one: the median step time of those with timed calls
    metrics = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    times = sorted((line["timing_s/step"], line["step"]) for line in metrics if line["step"] > 0)
    assert chosen_step(__import__("flowrl.ui.report", fromlist=["RunFiles"]).RunFiles.read(run_folder), None) == \
        times[len(times) // 2][1]


def test_faults_moves_and_resumes_are_marked(tmp_path: Path) -> None:
    from flowrl.ui.report import RunFiles

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "elapsed_s": step * 2.0}) + "\n"
                                                     for step in range(1, 5)))
    events = [{"kind": "resume", "step": 2, "message": "resumed from step-2 at step 3"},
              {"kind": "fault", "step": 3, "message": "lost cpu-1"}, {"kind": "warning", "step": 3, "message": "x"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    files = RunFiles.read(tmp_path)
    assert [(mark.x, mark.kind) for mark in files.marks(on_time=False)] == [(2.0, "resume"), (3.0, "fault")]
    assert [mark.x for mark in files.marks(on_time=True)] == [4.0, 6.0]


def test_bad_folders_and_steps_are_clear_errors(run_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FlowrlError, match="no metrics.jsonl here"):
        build_report(tmp_path)
    with pytest.raises(FlowrlError, match=r"--step 99: the run has node calls for steps 1..6"):
        build_report(run_folder, tmp_path / "r", step=99)
    with pytest.raises(FlowrlError, match="no such folder"):
        build_report(tmp_path / "missing")
    (tmp_path / "taken").write_text("")  # where the report's folder should go: a file
    with pytest.raises(FlowrlError, match=r"cannot write the report in .*taken: File exists; write it elsewhere"):
        build_report(run_folder, tmp_path / "taken")


@pytest.mark.skipif(shutil.which("chromium") is None or shutil.which("chromedriver") is None,
                    reason="needs Chromium and its driver (Debian: apt install chromium chromium-driver)")
def test_the_page_opens_in_headless_chromium_with_every_picture(run_folder: Path, tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    page = build_report(run_folder, tmp_path / "report", step=4)
    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    try:
        driver.get(page.as_uri())
        loaded = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete && i.naturalWidth > 0, i.naturalWidth])")
        assert len(loaded) == 5 and all(ok for _, ok, _ in loaded), loaded
        assert "Step 4, measured" in driver.find_element("tag name", "body").text
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
        shot = driver.get_screenshot_as_png()
    finally:
        driver.quit()
    from matplotlib import image

    assert image.imread(io.BytesIO(shot), format="png").shape[1] > 300
