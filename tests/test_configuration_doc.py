"""docs/configuration.md agrees with the code that reads the configuration."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from engine.__main__ import ENVIRONMENT, build_parser
from gateway.core.settings import Settings, env_name, markdown_table
from stack.configdoc import DOC, render


def test_the_configuration_doc_holds_exactly_what_the_code_generates() -> None:
    text = DOC.read_text()
    assert render(text) == text, "run `python -m stack.configdoc` and commit the result"


def test_every_gateway_setting_and_engine_flag_and_variable_is_in_the_doc() -> None:
    text = DOC.read_text()
    for field in Settings.__struct_fields__:
        assert f"| `{env_name(field)}` |" in text, field
    for action in build_parser().flags:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in text, flag
    for name in ENVIRONMENT:
        assert f"| `{name}` |" in text, name


def test_python_m_gateway_settings_prints_the_gateway_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.core.settings"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(DOC.parent.parent)},
        cwd=DOC.parent.parent,
    )
    assert result.stdout == markdown_table()
    assert result.stdout in DOC.read_text()
    # every row has a meaning, not just a name
    for row in result.stdout.splitlines()[2:]:
        variable, default, meaning = (cell.strip() for cell in row.strip("|").split("|"))
        assert variable and default and meaning, row


def test_a_wrong_value_in_the_environment_is_refused_with_the_variable_named() -> None:
    with pytest.raises(msgspec.ValidationError, match="shutdown_grace_s"):
        Settings.from_env({"TOKENSPOUT_SHUTDOWN_GRACE_S": "-1"})
    assert Settings.from_env({"TOKENSPOUT_SHUTDOWN_GRACE_S": "7"}).shutdown_grace_s == 7
