"""`mtplm generate --json-schema FILE | --regex R | --grammar FILE` in-process (cli.main)."""

from __future__ import annotations

import json

import pytest

from grammar_model import json_mtp
from mtplm.cli import main

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return json_mtp(seed=2).save(tmp_path_factory.mktemp("json-model"))


def _generate(model_dir, *options: str) -> list[str]:
    return [
        "generate",
        "{",
        "--model",
        str(model_dir),
        "--raw",
        "--dtype",
        "fp32",
        "--backend",
        "eager",
        "--max-new-tokens",
        "40",
        "--no-stream",
        *options,
    ]


@pytest.mark.parametrize("mode", ["ntp", "verified"])
def test_json_schema_answer_is_valid_and_counts_forced_tokens(model_dir, tmp_path, capsys, mode):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(_generate(model_dir, "--mode", mode, "--json-schema", str(schema))) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["kind"] in ("cat", "dog")
    assert "forced +" in err and "complete" in err and "INCOMPLETE" not in err


def test_regex_and_grammar(model_dir, tmp_path, capsys):
    assert main(_generate(model_dir, "--mode", "ntp", "--regex", r"\d{4}-\d{2}")) == 0
    out, _ = capsys.readouterr()
    assert len(out.strip()) == 7 and out[4] == "-"
    grammar = tmp_path / "yes.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert main(_generate(model_dir, "--mode", "ntp", "--grammar", str(grammar))) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_length_inside_a_constraint_says_incomplete(model_dir, tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}')
    args = _generate(model_dir, "--mode", "ntp", "--json-schema", str(schema))
    args[args.index("--max-new-tokens") + 1] = "5"
    assert main(args) == 0
    assert "INCOMPLETE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option,value,needle",
    [
        ("--json-schema", '{"type": "objekt"}', "Invalid type: objekt"),
        ("--json-schema", '{"type": "integer", "minimum": 3, "maximum": 1}', "Unsatisfiable"),
        ("--json-schema", "{oops", "not valid JSON"),
        ("--json-schema", None, "cannot read"),
        ("--regex", "a[^\\s\\S]", "matches no text"),
        ("--grammar", "start: missing", "unknown name"),
    ],
)
def test_bad_constraints_are_one_line_and_exit_2(model_dir, tmp_path, capsys, option, value, needle):
    if option == "--regex":
        given = value
    else:
        given = str(tmp_path / "spec")
        if value is not None:
            (tmp_path / "spec").write_text(value)
    assert main(_generate(model_dir, "--mode", "ntp", option, given)) == 2
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if "error" in line]  # the rest: the model loader's progress bar
    assert (
        len(errors) == 1
        and errors[0].startswith(f"mtplm generate: error: {option}: ")
        and needle in errors[0]
    )
    assert "Traceback" not in "".join(err)
