"""What the library says (jaxtrain.io.console): its log records shown as a terminal's lines, routed or silenced by
the caller's own logging."""

import logging
import subprocess
import sys
import threading

from jaxtrain.io import console

log = logging.getLogger("jaxtrain.test")


def test_lines_show_progress_on_stdout_and_warnings_on_stderr_and_leave_the_logger_as_it_was(capsys):
    logger = logging.getLogger("jaxtrain")
    before = (list(logger.handlers), logger.propagate, logger.level)
    with console.lines(lambda text: text.replace("workers=2", "--workers 2")):
        log.info("epoch 1/1: fine")
        log.warning("workers=2 is many")
        log.debug("not shown")
    assert capsys.readouterr() == ("epoch 1/1: fine\n", "warning: --workers 2 is many\n")
    assert (list(logger.handlers), logger.propagate, logger.level) == before
    log.info("after: not shown")  # the logger's level is the root's again (WARNING)
    assert capsys.readouterr().out == ""


def test_a_callers_own_handler_gets_the_records_and_nothing_is_printed(capsys):
    got = []
    handler = logging.Handler(logging.INFO)
    handler.emit = got.append
    logger = logging.getLogger("jaxtrain")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with console.lines():
            log.info("routed")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert [r.getMessage() for r in got] == ["routed"] and capsys.readouterr() == ("", "")


def test_a_silenced_logger_stays_silent(capsys):
    logger = logging.getLogger("jaxtrain")
    logger.setLevel(logging.WARNING)
    try:
        with console.lines():
            log.info("progress")
            log.warning("still said")
    finally:
        logger.setLevel(logging.NOTSET)
    assert capsys.readouterr() == ("", "warning: still said\n")


def test_runs_in_two_threads_at_once_both_keep_their_lines(capsys):
    """The first run to end removed the shared handler: the other's lines were lost from then on."""
    first_in, first_out = threading.Event(), threading.Event()

    def first():
        with console.lines():
            first_in.set()
            first_out.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(10)
    with console.lines():
        first_out.set()
        thread.join(10)
        log.info("the second run, after the first ended")
    assert capsys.readouterr().out == "the second run, after the first ended\n"


def test_a_call_made_alone_says_its_lines(capsys):
    @console.shown
    def load():
        log.info("converting the files (once) ...")
        return 3

    assert load() == 3 and capsys.readouterr().out == "converting the files (once) ...\n"


def test_the_last_line_before_an_immediate_exit_is_written_by_a_buffering_handler(tmp_path):
    """``os._exit`` skips every clean-up: a handler that buffers (a caller's file or queue) lost the line."""
    code = (f"import logging, logging.handlers\nfrom jaxtrain.io import console\n"
            f"target = logging.FileHandler({str(tmp_path / 'log')!r})\n"
            "logging.getLogger('jaxtrain').addHandler(logging.handlers.MemoryHandler(1000, target=target))\n"
            "logging.getLogger('jaxtrain.x').error('the last line')\nconsole.exit_now(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "log").read_text() == "the last line\n"
