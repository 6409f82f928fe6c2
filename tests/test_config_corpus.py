"""A corpus of malformed config files (issue 53): wrong types, sizes, nesting, aliases, encodings, tags, duplicate
keys, empty lists, counts that mean nothing, non-finite numbers, huge values. Each goes through `grpo train
--dry-run` in this process and must end in exit 2, exactly one `error:` line (with the summary line the CLI prints
after a config's errors), no traceback, within seconds: an alias bomb or a file nested ten thousand levels deep is
refused from its first few hundred nodes, not expanded or recursed into."""

import textwrap
import time

from grpo_core.cli import main
from grpo_core.config.yaml_file import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUE_CHARS, MAX_VALUES

SUMMARY = "problem(s) in the configuration; nothing was started"
SMALL = ["actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-135M"]  # the defaults' 7B model needs offloading


def _nested_mappings(levels: int) -> str:
    return "".join(f"{'  ' * i}k{i}:\n" for i in range(levels)) + f"{'  ' * levels}leaf: 1\n"


def _billion_laughs() -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\ntrainer:\n  project_name: *l9\n"


def _alias_chain() -> str:
    """Each anchor nests the one before it 20 levels deeper: within the limit as written, past it once expanded."""
    deep = "[" * 20 + "1" + "]" * 20
    return f"a: &a {deep}\nb: &b {'[' * 20}*a{']' * 20}\n"


OPTIM = "actor_rollout_ref:\n  actor:\n    optim:\n"
SEC = "actor_rollout_ref:\n  actor:\n    megatron:\n      override_transformer_config:\n"

CASES = [  # (name, the file's content: text or bytes, extra overrides, what the error line says)
    # --- types
    ("a word for an int", "data:\n  train_batch_size: many\n", [], "data.train_batch_size='many' is not a valid int"),
    ("a list for an int", "trainer:\n  nnodes: [1, 2]\n", [], "is not a valid int"),
    ("a float for an int", "trainer:\n  total_epochs: 1.5\n", [], "trainer.total_epochs=1.5 is not a valid int"),
    ("a word for a bool", "trainer:\n  val_before_train: maybe\n", [], "is not a valid bool"),
    ("a word for a float", f"{OPTIM}      lr: fast\n", [], "optim.lr='fast' is not a valid float"),
    ("a mapping for a list", "data:\n  train_files: {a: 1}\n", [], "data.train_files="),
    ("a list of lists for a list of names", "data:\n  train_files: [[a.parquet]]\n", [], "data.train_files="),
    ("a mapping inside trainer.env", "trainer:\n  env:\n    A: {B: 1}\n", [], "trainer.env"),
    ("a value for a section", "data: 5\n", [], "'data' is a section, not a value"),
    ("a list for a section", "trainer: [1, 2]\n", [], "'trainer' is a section, not a value"),
    ("a list at the top", "- a\n- b\n", [], "the top level must be a mapping of sections, got list"),
    ("a word at the top", "hello\n", [], "the top level must be a mapping of sections, got str"),
    ("a list as a key", "? [a, b]\n: 1\n", [], "found unhashable key"),
    ("an unknown key", "trainer:\n  n_gpu_per_node: 8\n", [], "did you mean 'trainer.n_gpus_per_node'"),
    # --- sizes
    ("a file over the size limit", "#" + "x" * MAX_FILE_BYTES, [], "too large for a config file"),
    (
        "a value of 100,000 characters",
        f"trainer:\n  experiment_name: {'x' * 100_000}\n",
        [],
        f"a value of 100,000 characters (at most {MAX_VALUE_CHARS:,})",
    ),
    ("an integer of 5,000 digits", f"data:\n  seed: {'9' * 5000}\n", [], "as !!int (Exceeds the limit"),
    ("an integer past 64 bits", "data:\n  seed: 99999999999999999999999\n", [], "data.seed: an integer of 77 bits"),
    (
        "an override of 70,000 characters",
        "{}\n",
        [f"trainer.experiment_name={'x' * 70_000}"],
        "override 'trainer.experiment_name=…': a value of 70,000 characters",
    ),
    ("a key over YAML's 1024 characters", f"trainer:\n  {'k' * 2000}: 1\n", [], "malformed YAML"),
    # --- nesting
    ("ten thousand nested lists", f"a: {'[' * 10_000}{']' * 10_000}\n", [], f"nested more than {MAX_DEPTH} levels"),
    ("two hundred nested mappings", _nested_mappings(200), [], f"nested more than {MAX_DEPTH} levels deep"),
    (
        "a deep free-form section",
        "actor_rollout_ref:\n  model:\n    override_config:\n" + textwrap.indent(_nested_mappings(40), "      "),
        [],
        f"nested more than {MAX_DEPTH} levels deep",
    ),
    (
        "an override nested 40 levels",
        "{}\n",
        ["+actor_rollout_ref.model.override_config." + ".".join(["a"] * 40) + "=1"],
        f"nested more than {MAX_DEPTH} levels deep",
    ),
    # --- aliases
    ("a billion laughs", _billion_laughs(), [], f"more than {MAX_VALUES:,} values once its aliases are expanded"),
    (
        "a quadratic blow-up",
        f"a: &a [{', '.join(['x'] * 200)}]\nb: [{', '.join(['*a'] * 100)}]\n",
        [],
        "values once its aliases are expanded",
    ),
    (
        "merge keys that multiply",
        "m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9, j: 10}\n"
        + "".join(
            f"m{i}: &m{i} {{<<: *m{i - 1}, {', '.join(f'k{j}: *m{i - 1}' for j in range(10))}}}\n" for i in range(1, 6)
        ),
        [],
        "values once its aliases are expanded",
    ),
    ("a list that holds itself", "a: &a [*a]\n", [], "a recursive alias"),
    ("a mapping that holds itself", "a: &a {b: *a}\n", [], "a recursive alias"),
    ("an alias to no anchor", "trainer:\n  project_name: *nope\n", [], "found undefined alias 'nope'"),
    ("aliases that nest past the limit", _alias_chain(), [], "levels deep once its aliases are expanded"),
    # --- encodings
    ("Latin-1", "trainer:\n  project_name: café\n".encode("latin-1"), [], "not UTF-8 text (byte 0xe9"),
    ("UTF-16 with a BOM", "trainer:\n  project_name: x\n".encode("utf-16"), [], "not UTF-8 text (byte 0xff"),
    ("a PNG", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", [], ":1: not UTF-8 text (byte 0x89 at offset 0)"),
    ("a NUL byte", "trainer:\n  project_name: a\x00b\n", [], ":2: control character U+0000 is not allowed"),
    ("a terminal escape", "trainer:\n  project_name: \x1b[31mred\n", [], "control character U+001B"),
    ("a cut multi-byte character", b"trainer:\n  project_name: caf\xc3", [], ":2: not UTF-8 text (byte 0xc3"),
    ("an encoded surrogate", b"trainer:\n  project_name: \xed\xa0\x80\n", [], "not UTF-8 text (byte 0xed"),
    # --- tags
    (
        "a Python call",
        "trainer:\n  project_name: !!python/object/apply:os.system [echo owned]\n",
        [],
        "unknown tag '!!python/object/apply:os.system'",
    ),
    (
        "a Python name",
        "trainer:\n  project_name: !!python/name:os.system\n",
        [],
        "unknown tag '!!python/name:os.system",
    ),
    ("an include tag", "trainer: !include other.yaml\n", [], "unknown tag '!include'"),
    ("binary data", "trainer:\n  project_name: !!binary aGVsbG8=\n", [], "tag '!!binary'"),
    ("a set", "trainer:\n  logger: !!set {console: null}\n", [], "tag '!!set'"),
    ("a word tagged a float", f"{OPTIM}      lr: !!float fast\n", [], "cannot read 'fast' as !!float"),
    ("a word tagged a bool", "trainer:\n  val_before_train: !!bool maybe\n", [], "cannot read 'maybe' as !!bool"),
    # --- duplicate keys
    ("a section twice", "trainer:\n  nnodes: 1\ntrainer:\n  nnodes: 2\n", [], ":3: duplicate key 'trainer' (first"),
    (
        "a setting twice",
        "trainer:\n  save_freq: 10\n  test_freq: 5\n  save_freq: 20\n",
        [],
        ":4: duplicate key 'trainer.save_freq' (first on line 2)",
    ),
    ("a key twice in a flow mapping", "data: {seed: 1, seed: 2}\n", [], "duplicate key 'data.seed'"),
    ("quoted and plain", "trainer:\n  nnodes: 1\n  'nnodes': 2\n", [], "duplicate key 'trainer.nnodes'"),
    # --- empty lists and names
    ("no training files", "data:\n  train_files: []\n", [], "data.train_files=[]: no training data"),
    (
        "no validation files for a run that validates",
        "data:\n  val_files: []\ntrainer:\n  test_freq: 5\n",
        [],
        "data.val_files=[]: the run validates (trainer.test_freq=5)",
    ),
    ("an empty file name", "data:\n  train_files: ['']\n", [], "data.train_files=['']: an empty file name"),
    # --- counts
    ("no steps", "trainer:\n  total_training_steps: 0\n", [], "trainer.total_training_steps=0 must be >= 1 (or null)"),
    ("negative steps", "trainer:\n  total_training_steps: -5\n", [], "trainer.total_training_steps=-5 must be >= 1"),
    ("no epochs", "trainer:\n  total_epochs: 0\n", [], "trainer.total_epochs=0 must be >= 1"),
    ("a save every 0 steps", "trainer:\n  save_freq: 0\n", [], "trainer.save_freq=0 must be -1 (off) or >= 1"),
    ("a test every -3 steps", "trainer:\n  test_freq: -3\n", [], "trainer.test_freq=-3 must be -1 (off) or >= 1"),
    ("no PPO epochs", "actor_rollout_ref:\n  actor:\n    ppo_epochs: 0\n", [], "ppo_epochs=0 must be >= 1"),
    ("an evaluation batch of 0", "evaluation:\n  batch_size: 0\n", [], "evaluation.batch_size=0 must be >= 1"),
    (
        "no validation samples",
        "actor_rollout_ref:\n  rollout:\n    val_kwargs:\n      n: 0\n",
        [],
        "actor_rollout_ref.rollout.val_kwargs.n=0 must be >= 1",
    ),
    ("a negative NCCL timeout", "actor_rollout_ref:\n  nccl_timeout: -1\n", [], "nccl_timeout=-1 must be >= 1"),
    # --- numbers that are not
    ("NaN", f"{OPTIM}      lr: .nan\n", [], "optim.lr=nan: not a finite number"),
    ("infinity", "actor_rollout_ref:\n  actor:\n    grad_clip: .inf\n", [], "grad_clip=inf: not a finite number"),
    ("minus infinity", "algorithm:\n  kl_ctrl:\n    kl_coef: -.inf\n", [], "kl_coef=-inf: not a finite number"),
    ("a nested NaN", f"{SEC}        hidden_dropout: .nan\n", [], "hidden_dropout=nan: not a finite number"),
    # --- YAML that is not
    ("a tab for indentation", "trainer:\n\tnnodes: 1\n", [], "malformed YAML"),
    ("two documents", "trainer:\n  nnodes: 1\n---\ndata:\n  seed: 2\n", [], "expected a single document"),
    ("an unclosed quote", "trainer:\n  project_name: 'grpo\n", [], "malformed YAML"),
    ("an interpolation of nothing", "trainer:\n  project_name: ${data.no_such_key}\n", [], "trainer.project_name"),
]


def test_the_corpus_each_exits_2_with_one_line_fast(tmp_path, capsys):
    good = tmp_path / "good.yaml"  # aliases are YAML: a small file may reuse a value
    good.write_text("trainer:\n  project_name: &name grpo\n  experiment_name: *name\n")
    assert main(["train", "--config", str(good), "--dry-run", *SMALL]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert len(CASES) >= 40
    for number, (name, content, overrides, says) in enumerate(CASES):
        path = tmp_path / f"case{number}.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        started = time.monotonic()
        status = main(["train", "--config", str(path), "--dry-run", *SMALL, *overrides])
        seconds = time.monotonic() - started
        out, err = capsys.readouterr()
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1, (name, status, err[-2000:])
        assert says in errors[0], (name, errors[0][:500])
        assert SUMMARY in err.splitlines()[-1] and "Traceback" not in out + err, (name, err[-2000:])
        assert seconds < 10, (name, seconds)
