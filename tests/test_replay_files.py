"""Router replay's trace files, checked whole (#51): a flipped bit in the routing data, a truncated or
empty file, each malformed header field and each bad entry fail at `RoutingTrace.load` with one line
naming the file; a token naming one expert in two slots fails when the replay starts; a trace written
before the checksum still loads."""
import json

import pytest
import torch

import fmoe
from tests.test_replay import one_thread  # noqa: F401 (autouse: tiny tensors, one thread)

D, H, E, T = 8, 12, 8, 6
SUFFIXES = [".safetensors", ".pt"]
# Distinct ids in [0, E) whose int32 bytes occur once in a file: a flipped low bit stays in range.
IDS_TK = torch.tensor([[2, 5], [1, 7], [3, 4], [6, 0], [4, 2], [0, 6]])


def saved(tmp_path, suffix, layers=None, name="trace"):
    path = tmp_path / f"{name}{suffix}"
    fmoe.RoutingTrace(layers or {"0": [IDS_TK, IDS_TK[:4].flip(1)], "1": [IDS_TK.roll(1, 0)]}).save(path)
    return path


def refused(path, message):
    """Loading `path` fails with a TraceFileError naming the file and matching `message`."""
    with pytest.raises(ValueError, match=message) as err:
        fmoe.RoutingTrace.load(path)
    assert type(err.value).__name__ == "TraceFileError"
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def read_back(path):
    """(header, tensors by key) of a trace file, however it is stored."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()["fmoe"]), {key: f.get_tensor(key) for key in f.keys()}
    stored = torch.load(path, weights_only=True)
    return {k: v for k, v in stored.items() if k != "entries"}, stored["entries"]


def write_raw(path, header, tensors):
    """A trace file holding `header` and `tensors` as they are (no checks, no checksum added; a .pt file
    with `tensors` None has no entries)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(tensors, str(path), metadata={"fmoe": json.dumps(header)})
    else:
        torch.save({**header, **({} if tensors is None else {"entries": tensors})}, path)


def rewritten(path, **changes):
    """The file at `path` written again with its header fields changed (None: removed)."""
    header, tensors = read_back(path)
    for field, value in changes.items():
        if value is None:
            header.pop(field, None)
        else:
            header[field] = value
    write_raw(path, header, tensors)
    return path


# --- a: the checksum ------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_flipped_bit_in_a_stored_expert_id_fails_the_checksum(tmp_path, suffix):
    path = saved(tmp_path, suffix)
    data = bytearray(path.read_bytes())
    ids = IDS_TK.to(torch.int32).numpy().tobytes()
    assert data.count(ids) == 1
    data[data.find(ids)] ^= 1               # expert 2 becomes 3: still in range, another expert
    path.write_bytes(data)
    refused(path, "is corrupt: its routing data fails the SHA-256 its header records")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_trace_written_before_the_checksum_still_loads(tmp_path, suffix):
    path = rewritten(saved(tmp_path, suffix), sha256=None)
    assert "sha256" not in read_back(path)[0]
    loaded = fmoe.RoutingTrace.load(path)
    assert torch.equal(loaded["0"][0], IDS_TK) and torch.equal(loaded["1"][0], IDS_TK.roll(1, 0))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_checksum_over_other_data_is_refused(tmp_path, suffix):
    other = read_back(saved(tmp_path, suffix, {"0": [IDS_TK.flip(0)]}, name="other"))[0]["sha256"]
    refused(rewritten(saved(tmp_path, suffix), sha256=other), "fails the SHA-256")


# --- b: truncated and empty files -------------------------------------------------------------------

@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("keep", [0.5, 0.98, 16])
def test_a_truncated_file_names_the_file(tmp_path, suffix, keep):
    path = saved(tmp_path, suffix)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    refused(path, "is truncated or corrupt: .* cannot read it")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_empty_file_names_the_file(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(b"")
    refused(path, r"is empty \(0 bytes\)")


def test_a_missing_file_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no routing trace at {tmp_path / 'none.pt'}"):
        fmoe.RoutingTrace.load(tmp_path / "none.pt")


def test_safetensors_metadata_that_is_not_json_names_the_file(tmp_path):
    from safetensors.torch import save_file
    path = tmp_path / "trace.safetensors"
    save_file({"0.0": IDS_TK.to(torch.int32)}, str(path), metadata={"fmoe": '{"format": "fmoe.routing_trace"'})
    refused(path, r"is truncated or corrupt: json \(its 'fmoe' metadata\) cannot read it")


# --- c: every header field, its type and range --------------------------------------------------------

BAD_FIELDS = [
    # (formats, field, value (None: missing), message)
    (SUFFIXES, "version", None, "its header has no field 'version'"),
    (SUFFIXES, "version", True, "header field 'version' must be the int 1, got True"),
    (SUFFIXES, "version", "1", "header field 'version' must be the int 1, got '1'"),
    (SUFFIXES, "layers", None, "its header has no field 'layers'"),
    (SUFFIXES, "layers", "01", r"header field 'layers' must be a list of distinct layer names \(str\), got '01'"),
    (SUFFIXES, "layers", [0, 1], r"header field 'layers' must be a list of distinct layer names \(str\), got \[0, 1\]"),
    (SUFFIXES, "layers", ["0", "0"], r"header field 'layers' must be a list of distinct layer names"),
    (SUFFIXES, "sha256", "abc", r"header field 'sha256' must be a SHA-256 digest \(64 lowercase hex digits\)"),
    (SUFFIXES, "sha256", 7, r"header field 'sha256' must be a SHA-256 digest"),
    ([".safetensors"], "forwards", None, "its header has no field 'forwards'"),
    ([".safetensors"], "forwards", [-1, 1], r"header field 'forwards' must be a list of 2 ints >= 0 \(each layer's "
                                            r"forwards\), got \[-1, 1\]"),
    ([".safetensors"], "forwards", [2], r"header field 'forwards' must be a list of 2 ints >= 0"),
    ([".safetensors"], "forwards", [2.0, 1], r"header field 'forwards' must be a list of 2 ints >= 0"),
    ([".safetensors"], "forwards", "21", r"header field 'forwards' must be a list of 2 ints >= 0"),
    ([".pt"], "entries", None, "its header has no field 'entries'"),
    ([".pt"], "entries", [[IDS_TK]], r"header field 'entries' must be a list of 2 lists of tensors"),
    ([".pt"], "entries", [IDS_TK, IDS_TK], r"header field 'entries' must be a list of 2 lists of tensors"),
    ([".pt"], "entries", [[IDS_TK], [[2, 5]]], r"header field 'entries' must be a list of 2 lists of tensors"),
]


@pytest.mark.parametrize("suffix,field,value,message",
                         [pytest.param(s, f, v, m, id=f"{s}-{f}-{i}") for i, (formats, f, v, m) in enumerate(BAD_FIELDS)
                          for s in formats])
def test_each_bad_header_field_is_refused_naming_the_file_and_field(tmp_path, suffix, field, value, message):
    path = saved(tmp_path, suffix)
    header, tensors = read_back(path)
    if field == "entries":
        tensors = value
    elif value is None:
        del header[field]
    else:
        header[field] = value
    write_raw(path, header, tensors)
    refused(path, message)


def test_a_safetensors_tensor_missing_or_extra_to_the_header_is_refused(tmp_path):
    path = saved(tmp_path, ".safetensors")
    header, tensors = read_back(path)
    write_raw(path, header, {k: v for k, v in tensors.items() if k != "0.1"})
    refused(path, r"has no tensor '0.1' \(layer '0', forward 2\) though its header's 'forwards' lists it")
    write_raw(path, header, {**tensors, "1.1": tensors["1.0"].clone()})
    refused(path, r"holds tensors \['1.1'\] that its header's 'forwards' does not list")


# --- the entries a file holds --------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("entry,got", [(IDS_TK.float(), r"torch.float32 \(6, 2\)"),
                                       (IDS_TK.flatten().to(torch.int32), r"torch.int32 \(12,\)"),
                                       (IDS_TK.bool(), r"torch.bool \(6, 2\)")])
def test_an_entry_of_another_dtype_or_shape_is_refused_naming_layer_and_forward(tmp_path, suffix, entry, got):
    path = tmp_path / f"trace{suffix}"
    header = {"format": "fmoe.routing_trace", "version": 1, "layers": ["0"], "forwards": [1]}
    write_raw(path, header, {"0.0": entry} if suffix == ".safetensors" else [[entry]])
    refused(path, rf"layer '0', forward 1: an entry must be an integer tensor \[tokens, top_k\], got {got}")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_id_below_minus_one_is_refused_at_load(tmp_path, suffix):
    path = saved(tmp_path, suffix, {"0": [IDS_TK], "1": [IDS_TK, IDS_TK - 3]})
    refused(path, "layer '1', forward 2: expert ids must be >= -1, got -3")


# --- d: one token, one expert, two slots ------------------------------------------------------------

def make_layer(gate="naive", top_k=2):
    torch.manual_seed(0)
    return fmoe.FMoETransformerMLP(num_expert=E, d_model=D, d_hidden=H, top_k=top_k, gate=gate)


def test_a_token_naming_one_expert_in_two_slots_is_refused_when_replay_starts():
    layer = make_layer()
    idx_TK = IDS_TK.clone()
    idx_TK[3] = torch.tensor([5, 5])
    with pytest.raises(ValueError, match=r"replay_routing: layer '', forward 2: token 3 \(counting from 0\) names an "
                                         r"expert in two slots, \[5, 5\]; its NaiveGate sends a token to an expert "
                                         "at most once"):
        with fmoe.replay_routing(layer, fmoe.RoutingTrace({"": [IDS_TK, idx_TK]})):
            pass
    assert layer.gate.routing_mode is None


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_saved_trace_with_a_repeated_expert_loads_and_is_refused_by_replay(tmp_path, suffix):
    idx_TK = IDS_TK.clone()
    idx_TK[5] = torch.tensor([6, 6])
    trace = fmoe.RoutingTrace.load(saved(tmp_path, suffix, {"": [idx_TK]}))
    with pytest.raises(ValueError, match=r"forward 1: token 5 \(counting from 0\) names an expert in two slots"):
        with fmoe.replay_routing(make_layer(), trace):
            pass


def test_slots_reaching_no_expert_may_repeat_and_a_zero_gate_replays_its_own_repeats():
    idx_TK = IDS_TK.clone()
    idx_TK[0] = torch.tensor([-1, -1])
    layer = make_layer()
    with fmoe.replay_routing(layer, fmoe.RoutingTrace({"": [idx_TK]})):
        layer(torch.randn(T, D))
    zero = make_layer("zero")
    with fmoe.record_routing(zero) as trace:
        zero(torch.randn(T, D))
    assert torch.equal(trace[""][0], torch.zeros(T, 2, dtype=torch.long))
    with fmoe.replay_routing(zero, trace):
        zero(torch.randn(T, D))
