import io
import re

import pytest

from realhf.base import logging


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_logger_prints_worker_name_plain_when_not_a_tty(capsys):
    log = logging.getLogger("model_worker/7")
    log.info("hello %d", 3)
    err = capsys.readouterr().err
    assert re.search(r"model_worker/7 INFO: hello 3", err)
    assert "\033[" not in err
    assert logging.getLogger("model_worker/7") is log  # cached, no extra handlers
    # exactly one printing handler, on the package logger, whatever was created since
    package = logging._std_logging.getLogger("realhf")
    assert [type(h) for h in package.handlers].count(logging._StderrHandler) == 1
    assert log.handlers == [] and log.propagate


def test_colour_only_on_tty():
    fmt = logging._ColourFormatter(logging.LOG_TYPES["system"], _Tty())
    rec = logging._std_logging.LogRecord("x", logging.WARNING, __file__, 1, "careful", None, None)
    assert fmt.format(rec).startswith("\033[33m") and fmt.format(rec).endswith("\033[0m")
    plain = logging._ColourFormatter(logging.LOG_TYPES["system"], io.StringIO())
    assert "\033[" not in plain.format(rec)


def test_file_handler_gets_plain_records_of_all_loggers(tmp_path):
    path = tmp_path / "logs" / "master_worker_0.log"
    early = logging.getLogger("early_worker")
    handler = logging.add_file_handler(str(path))
    assert logging.add_file_handler(str(path)) is handler
    late = logging.getLogger("late_worker")
    early.warning("from early")
    late.error("from late")
    handler.flush()
    text = path.read_text()
    assert "early_worker WARNING: from early" in text
    assert "late_worker ERROR: from late" in text
    assert "\033[" not in text
    logging.remove_file_handler(str(path))
    early.warning("after removal")
    assert "after removal" not in path.read_text()


def test_unknown_type_and_bad_level(monkeypatch):
    with pytest.raises(ValueError, match="valid types"):
        logging.getLogger("x", type_="fancy")
    monkeypatch.setenv("REALHF_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="REALHF_LOG_LEVEL"):
        logging.getLogger("brand_new_logger_for_level_test")


def test_module_loggers_print_formatted_info_and_reach_worker_files(capsys, tmp_path):
    # realhf modules use the standard `logging.getLogger(__name__)`; their INFO lines used
    # to vanish (no handler above them) and their warnings printed without a format.
    import logging as std

    path = tmp_path / "worker.log"
    logging.add_file_handler(str(path))
    try:
        mod = std.getLogger("realhf.impl.reward.some_module")
        mod.info("graded %d answers", 8)
        mod.warning("slow check")
        err = capsys.readouterr().err
        assert re.search(
            r"\d{8}-\d\d:\d\d:\d\d\.\d{3} realhf.impl.reward.some_module INFO: graded 8 answers",
            err,
        )
        assert "realhf.impl.reward.some_module WARNING: slow check" in err
        assert err.count("graded 8 answers") == 1  # printed once, not again via the root logger
        text = path.read_text()
        assert "INFO: graded 8 answers" in text and "WARNING: slow check" in text
    finally:
        logging.remove_file_handler(str(path))


def test_each_logger_keeps_its_format_through_the_shared_handler(capsys):
    logging.getLogger("timings", "benchmark").info("step 0.5 s")
    logging.getLogger("quiet_user", "plain").info("just the message")
    err = capsys.readouterr().err
    assert re.search(r"\[BENCH\] timings: step 0.5 s", err)
    assert "\njust the message\n" in "\n" + err
