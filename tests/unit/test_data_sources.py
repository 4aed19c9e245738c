"""`--data` by name, mixed: the spec syntax, datasets read with `datasets` (local dataset repository layouts written
here stand in for the Hub: `datasets.load_dataset_builder` takes a directory where it takes ORG/NAME), the column
shapes, mixtures with weights and N, the caches, and the errors a bad spec gets."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest

from eagle3_train.assets.conversation_records import normalize_turns
from eagle3_train.assets.conversations import load_conversations, resolve_source
from eagle3_train.assets.data_sources import resolve
from eagle3_train.assets.data_spec import parse_spec
from eagle3_train.assets.hub_datasets import NotFetched
from eagle3_train.assets.record_shapes import PAIRS
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch) -> Path:
    """Every cache under tmp_path, and no test reaching for the Hub."""
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(tmp_path / "cache"))
    for env in ("EAGLE3_TRAIN_DATA_CACHE", "HF_DATASETS_CACHE", "EAGLE3_TRAIN_HUB_MIRROR"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "cache"


def qa(i: int) -> dict:
    return {"question": f"What is {i} + {i}?", "answer": f"{2 * i}."}


def chat(cid: str, text: str) -> dict:
    return {"id": cid, "messages": [{"role": "user", "content": f"Say {text}."},
                                    {"role": "assistant", "content": text}]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset_repo(root: Path, configs: dict[str, dict[str, list[dict]]], fmt: str = "jsonl",
                 default: bool = True) -> Path:
    """A dataset repository laid out as on the Hub: one data file per config and split, README.md `configs:` (the
    first config the default, unless not `default`)."""
    lines = ["---", "configs:"]
    for i, (config, splits) in enumerate(configs.items()):
        lines += [f"- config_name: {config}", *(["  default: true"] if i == 0 and default else []), "  data_files:"]
        for split, rows in splits.items():
            rel = f"{config}/{split}-00000-of-00001.{fmt}"
            (root / config).mkdir(parents=True, exist_ok=True)
            if fmt == "parquet":
                datasets.Dataset.from_list(rows).to_parquet(root / rel)
            else:
                write_jsonl(root / rel, rows)
            lines += [f"  - split: {split}", f"    path: {rel}"]
    (root / "README.md").write_text("\n".join([*lines, "---", "# test dataset", ""]))
    return root


def qa_messages(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]


# ---- the syntax ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("sharegpt:2000", {"source": "sharegpt", "limit": 2000}),
    ("org/name@train:2000", {"source": "org/name", "split": "train", "limit": 2000}),
    ("openai/gsm8k:main@test", {"source": "openai/gsm8k", "config": "main", "split": "test"}),
    ("openai/gsm8k:main", {"source": "openai/gsm8k", "config": "main"}),
    ("org/name:cfg:50%2.5", {"source": "org/name", "config": "cfg", "limit": 50, "weight": 2.5}),
    ("hub:ultrachat@test_sft%70", {"source": "ultrachat", "split": "test_sft", "weight": 70.0, "hub": True}),
])
def test_spec_syntax(text, want):
    spec = parse_spec(text)
    unset = {k: getattr(spec, k) for k in ("config", "split", "limit", "weight", "hub") if k not in want}
    assert {k: getattr(spec, k) for k in want} == want
    assert all(v in (None, False) for v in unset.values()), unset


def test_an_existing_path_is_itself_whatever_it_holds(tmp_path):
    odd = write_jsonl(tmp_path / "chats:2@x%3.jsonl", [chat("c1", "one")])
    (conv,) = load_conversations(str(odd))[0]
    assert conv.id == "c1"


# ---- datasets by name (local dataset repository layouts) --------------------------------------------------------

def test_a_dataset_spec_reads_its_config_split_and_first_rows(tmp_path, caches, monkeypatch):
    rows = {"train": [qa(i) for i in range(6)], "test": [qa(100 + i) for i in range(4)]}
    other = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(3)]
    dataset_repo(tmp_path / "org" / "name", {"main": rows, "other": {"train": other}}, fmt="parquet")
    monkeypatch.chdir(tmp_path)  # ORG/NAME names the local copy, as it would the Hub dataset

    it, info = load_conversations("org/name@test:2")
    assert [c.messages for c in it] == [qa_messages(r) for r in rows["test"][:2]]
    (src,) = info.sources
    assert {k: src[k] for k in ("spec", "kind", "config", "split", "rows", "limit")} == {
        "spec": "org/name@test:2", "kind": "dataset-dir", "config": "main", "split": "test", "rows": 2, "limit": 2}
    assert src["dataset"] == str(tmp_path / "org" / "name") and re.fullmatch(r"[0-9a-f]{16}", src["revision"])
    assert Path(info.path).is_relative_to(caches / "data") and info.format == "question/answer"

    whole = list(load_conversations("org/name")[0])  # the default config, `train`
    assert [c.messages for c in whole] == [qa_messages(r) for r in rows["train"]]
    assert [c.messages[1]["content"] for c in load_conversations("org/name:other")[0]] == ["r0", "r1", "r2"]

    assert resolve_source("org/name@test:2") == Path(info.path)  # read again: the same file
    edited = [qa(200 + i) for i in range(4)]
    datasets.Dataset.from_list(edited).to_parquet(tmp_path / "org/name/main/test-00000-of-00001.parquet")
    it, again = load_conversations("org/name@test:2")  # an edited directory is read again
    assert again.path != info.path and again.sources[0]["revision"] != src["revision"]
    assert [c.messages for c in it] == [qa_messages(r) for r in edited[:2]]


def test_only_the_first_rows_are_read(tmp_path):
    """`:N` streams: the split's second file, broken, is never opened for the first rows."""
    repo = dataset_repo(tmp_path / "repo", {"default": {"train": [qa(i) for i in range(5)]}})
    (repo / "default" / "train-00000-of-00001.jsonl").rename(repo / "default" / "train-00000-of-00002.jsonl")
    (repo / "default" / "train-00001-of-00002.jsonl").write_text("{not json\n")
    (repo / "README.md").write_text((repo / "README.md").read_text().replace("00000-of-00001", "*"))
    assert len(list(load_conversations(f"{repo}@train:3")[0])) == 3
    with pytest.raises(Eagle3InputError, match=f"--data {repo}@train: the dataset directory .* could not be read"):
        load_conversations(f"{repo}@train")


def test_a_hub_id_reads_through_the_mirror_then_the_cache_without_the_hub(tmp_path, caches, monkeypatch):
    rows = [qa(i) for i in range(5)]
    mirror = tmp_path / "mirror"
    dataset_repo(mirror / "org" / "name", {"main": {"train": rows}})
    monkeypatch.setenv("EAGLE3_TRAIN_HUB_MIRROR", str(mirror))
    it, info = load_conversations("hub:org/name@train:3")
    assert [c.messages for c in it] == [qa_messages(r) for r in rows[:3]]
    assert Path(info.path) == caches / "data" / "org~name@train-first3.jsonl"
    assert info.sources[0]["kind"] == "hub" and info.sources[0]["read_from"] == str(mirror / "org" / "name")
    shutil.rmtree(mirror)  # from now on no copy of the dataset is reachable
    assert resolve_source("hub:org/name@train:3") == Path(info.path)
    with pytest.raises(Eagle3InputError) as e:
        load_conversations("hub:org/name@train:2")
    message = str(e.value)
    assert "--data hub:org/name@train:2" in message and "split train" in message and "\n" not in message
    assert str(caches / "data" / "org~name@train-first2.jsonl") in message


def test_a_slice_is_cut_from_a_whole_split_fetched_before(tmp_path, monkeypatch):
    rows = [qa(i) for i in range(5)]
    mirror = tmp_path / "mirror"
    dataset_repo(mirror / "org" / "name", {"main": {"train": rows}})
    monkeypatch.setenv("EAGLE3_TRAIN_HUB_MIRROR", str(mirror))
    whole = resolve_source("org/name@train")
    shutil.rmtree(mirror)
    it, info = load_conversations("org/name@train:2")
    assert [c.messages for c in it] == [qa_messages(r) for r in rows[:2]]
    assert info.sources[0]["cut_from"] == whole.name and info.sources[0]["rows"] == 2


def test_cached_only_fetches_and_writes_nothing(tmp_path, caches, monkeypatch):
    """What `run --dry-run` asks: the file a source has in the data cache, or NotFetched naming every source a run
    would fetch (or cut), with nothing read through `datasets` and nothing written."""
    mirror = tmp_path / "mirror"
    dataset_repo(mirror / "org" / "name", {"main": {"train": [qa(i) for i in range(4)]}})
    monkeypatch.setenv("EAGLE3_TRAIN_HUB_MIRROR", str(mirror))
    with pytest.raises(NotFetched) as e:
        resolve(["org/name@train%1", "gsm8k:5%1"], cached_only=True)
    assert str(e.value) == ("--data org/name@train%1: not fetched yet: would fetch org/name (config default, split "
                            "train); --data gsm8k:5%1: not fetched yet: would fetch openai/gsm8k (config main, split "
                            "train)")
    assert not caches.exists()
    whole = resolve_source("org/name@train")
    assert resolve("org/name@train", cached_only=True).path == whole  # in the cache: found there
    with pytest.raises(NotFetched, match=f"not cut yet: would take the first 2 rows of {re.escape(str(whole))}"):
        resolve("org/name@train:2", cached_only=True)
    assert sorted(p.name for p in whole.parent.iterdir()) == [whole.name, whole.with_suffix(".source.json").name]


def test_the_caches_follow_the_environment(tmp_path, caches, monkeypatch):
    repo = dataset_repo(tmp_path / "repo", {"main": {"train": [qa(1)]}})
    path = resolve_source(f"{repo}@train")
    assert path.is_relative_to(caches / "data") and list((caches / "datasets").iterdir())
    monkeypatch.setenv("EAGLE3_TRAIN_DATA_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    assert resolve_source(f"{repo}@train:1").is_relative_to(tmp_path / "mine")
    assert list((tmp_path / "hf").iterdir())  # datasets' own files (its locks) went where the user said


# ---- column shapes ------------------------------------------------------------------------------------------------

def test_conversations_with_role_content_read_like_their_messages_twin(tmp_path):
    """speculators and SpecForge write `conversations` with role/content: their prepared data is read as is."""
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "Paris."}]
    specforge = write_jsonl(tmp_path / "specforge.jsonl", [{"id": "x", "conversations": turns}])
    openai = write_jsonl(tmp_path / "openai.jsonl", [{"id": "x", "messages": turns}])
    (a,), (b,) = load_conversations(specforge)[0], load_conversations(openai)[0]
    assert a.messages == b.messages == turns


@pytest.mark.parametrize("user, answer", PAIRS)
def test_column_pairs_are_one_exchange(tmp_path, user, answer):
    f = write_jsonl(tmp_path / "pairs.jsonl", [{"id": "p", user: "Question?", answer: "Answer.", "extra": 1}])
    (conv,), info = load_conversations(f)
    assert conv.messages == [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": "Answer."}]
    assert info.format == f"{user}/{answer}"


def test_alpaca_input_and_conversational_prompt_completion(tmp_path):
    f = write_jsonl(tmp_path / "shapes.jsonl", [
        {"instruction": "Translate.", "input": "chat", "output": "cat", "system": "You translate."},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}])
    a, b, c = load_conversations(f)[0]
    assert a.messages == [{"role": "system", "content": "You translate."},
                          {"role": "user", "content": "Translate.\n\nchat"}, {"role": "assistant", "content": "cat"}]
    assert b.messages[0] == {"role": "user", "content": "Say hi."}
    assert c.messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_hermes_text_tool_calls_are_read_as_calls(tmp_path):
    """hermes-function-calling-v1's shape: calls as `<tool_call>` text (a Python dict literal), results wrapped in
    `<tool_response>`; without structured calls the tool turn would end the conversation as broken."""
    call = "<tool_call>\n{'arguments': {'symbol': 'TSLA'}, 'name': 'get_stock_price'}\n</tool_call>"
    record = {"id": "h", "conversations": [
        {"from": "system", "value": "You are a function calling AI model. <tools>[...]</tools>"},
        {"from": "human", "value": "Price of TSLA?"}, {"from": "gpt", "value": call},
        {"from": "tool", "value": '<tool_response>\n{"price": 180.5}\n</tool_response>'},
        {"from": "gpt", "value": "It trades at 180.5."}]}
    single = {"id": "s", "conversations": [{"from": "human", "value": "Price of TSLA?"},
                                           {"from": "gpt", "value": call}]}
    (conv, alone), _ = load_conversations(write_jsonl(tmp_path / "hermes.jsonl", [record, single]))
    assert conv.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_stock_price", "arguments": {"symbol": "TSLA"}}}]}
    assert conv.messages[3] == {"role": "tool", "content": '{"price": 180.5}'}
    assert normalize_turns(conv.messages) == (conv.messages, None)
    assert alone.messages[1] == {"role": "assistant", "content": call}  # no result to answer: the text as written


def test_a_dataset_of_no_known_shape_is_refused_naming_its_columns(tmp_path):
    repo = dataset_repo(tmp_path / "repo", {"main": {"train": [{"foo": "a", "bar": "b"}]}})
    with pytest.raises(Eagle3InputError, match=r"row 0: no conversation in its columns \['bar', 'foo'\]; expected "
                                               r"'conversations' or 'messages'.*question/answer") as e:
        load_conversations(f"{repo}@train")
    assert f"--data {repo}@train" in str(e.value)


# ---- mixtures -----------------------------------------------------------------------------------------------------

def chats(path: Path, prefix: str, n: int) -> Path:
    return write_jsonl(path, [chat(f"{prefix}{i}", f"{prefix} number {i}") for i in range(n)])


def test_weights_set_the_shares_and_n_caps_a_source(tmp_path):
    a, b = chats(tmp_path / "a.jsonl", "a", 30), chats(tmp_path / "b.jsonl", "b", 100)
    data = [f"{a}:20%1", f"{b}%3"]
    it, info = load_conversations(data)
    ids = [c.id for c in it]
    # the rule: shares 1/4 and 3/4; `a` gives at most 20, which sets the total at 80
    total = min(20 / (1 / 4), 100 / (3 / 4))
    taken_a = [i for i in ids if i.startswith("a")]
    taken_b = [i for i in ids if i.startswith("b")]
    assert (len(taken_a), len(taken_b)) == (round(total / 4), round(total * 3 / 4))
    assert sorted(taken_a) == sorted(f"a{i}" for i in range(len(taken_a)))  # each source's first conversations
    assert [int(i[1:]) for i in taken_b] == list(range(len(taken_b)))  # in their own order
    assert {i[0] for i in ids[:len(ids) // 4]} == {"a", "b"}  # interleaved: a first part holds both
    assert [(s["spec"], s["weight"], s["available"], s["rows"]) for s in info.sources] == [
        (data[0], 1.0, 20, len(taken_a)), (data[1], 3.0, 100, len(taken_b))]
    again = load_conversations(data)[1]
    assert (again.path, again.sha256) == (info.path, info.sha256)  # the same sources make the same file
    assert load_conversations(list(reversed(data)))[1].sha256 != info.sha256


def test_without_weights_every_conversation_is_used_once(tmp_path):
    a, b = chats(tmp_path / "a.jsonl", "a", 5), chats(tmp_path / "b.jsonl", "b", 7)
    with open(b, "a") as f:  # a conversation of `a`, word for word, in `b` too
        f.write(json.dumps({**chat("a0", "a number 0"), "id": "dup"}) + "\n")
    it, info = load_conversations([str(a), str(b)])
    ids = [c.id for c in it]
    assert sorted(ids) == sorted([f"a{i}" for i in range(5)] + [f"b{i}" for i in range(7)])
    assert info.duplicates_dropped == 1 and [s["rows"] for s in info.sources] == [5, 8]


def test_cached_only_names_the_mixture_a_run_would_write_and_uses_the_one_written(tmp_path, caches):
    """A dry run's view of a mixture: keyed from its parts alone, nothing written; NotFetched names the very file a run
    writes, and once written it is found with the same record of each source."""
    a, b = chats(tmp_path / "a.jsonl", "a", 3), chats(tmp_path / "b.jsonl", "b", 4)
    data = [f"{a}:2%1", f"{b}%1"]
    with pytest.raises(NotFetched) as e:
        resolve(data, cached_only=True)
    assert not caches.exists()
    built = resolve(data)
    assert str(e.value) == f"--data {data[0]} --data {data[1]}: mixture not built yet: would write {built.path}"
    found = resolve(data, cached_only=True)
    assert (found.path, found.sources) == (built.path, built.sources)


def test_a_mixture_counts_its_sources_bad_records_and_refuses_them_unless_skipped(tmp_path):
    a = chats(tmp_path / "a.jsonl", "a", 3)
    b = chats(tmp_path / "b.jsonl", "b", 3)
    with open(b, "a") as f:
        f.write("{broken\n")
    with pytest.raises(Eagle3InputError, match=r"b.jsonl, line 4: invalid_json.*--skip-bad-records"):
        load_conversations([str(a), str(b)])
    it, info = load_conversations([str(a), str(b)], skip_bad_records=True)
    assert len(list(it)) == 6 and info.bad_records == {"invalid_json": 1}


# ---- bad specs: one error naming the spec and what was expected ---------------------------------------------------

def test_a_dataset_of_several_configs_and_no_default_asks_for_one(tmp_path):
    repo = dataset_repo(tmp_path / "repo", {"easy": {"train": [qa(1)]}, "hard": {"train": [qa(2)]}}, default=False)
    with pytest.raises(Eagle3InputError, match=f"--data {repo}: .* has several configs: pick one with :CONFIG "
                                               f"\\(easy, hard\\)"):
        load_conversations(str(repo))
    assert [c.messages for c in load_conversations(f"{repo}:hard")[0]] == [qa_messages(qa(2))]


@pytest.mark.parametrize("make, pattern", [
    (lambda repo, files: "ultrachatt", r"unknown data preset 'ultrachatt'.*did you mean 'ultrachat'\?.*expected"),
    (lambda repo, files: f"{repo}@nope", r"has no split 'nope'; its splits: train, test"),
    (lambda repo, files: f"{repo}@train:abc", r"bad slice ':abc': N is the number of rows.*expected SOURCE"),
    (lambda repo, files: f"{repo}:nope", r"has no config 'nope'; its configs: main"),
    (lambda repo, files: f"{files[0]}%0", r"bad weight '%0'"),
    (lambda repo, files: "sharegpt@train", r"is one file, with no config or split"),
    (lambda repo, files: [f"{files[0]}%2", files[1]], r"has no weight while .* has one: give every --data a weight"),
])
def test_bad_specs_name_the_spec_and_what_was_expected(tmp_path, make, pattern):
    repo = dataset_repo(tmp_path / "repo", {"main": {"train": [qa(1)], "test": [qa(2)]}})
    files = [str(chats(tmp_path / "a.jsonl", "a", 2)), str(chats(tmp_path / "b.jsonl", "b", 2))]
    data = make(repo, files)
    with pytest.raises(Eagle3InputError) as e:
        load_conversations(data)
    message = str(e.value)
    named = data if isinstance(data, str) else data[1]
    assert named in message and re.search(pattern, message) and "\n" not in message, message
