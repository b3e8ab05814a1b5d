//! Interop of the safetensors and torch `.pt` formats with their reference readers
//! and writers (the real `torch` and `safetensors` Python packages of the project's
//! venv, through `tests/python/interop_helper.py`): files we write load there bit
//! for bit, files they write load here bit for bit, and a `.pt` whose pickle would
//! run code is refused.
//!
//! Python is `$CKPT_PYTHON`, or `.venv/bin/python` under the workspace root.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use ckpt_core::{DType, Key, State, Tensor, Value};
use ckpt_formats::torch::{dtypes, tree};
use ckpt_tests::tensor;
use serde_json::{json, Value as Json};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn python(cmd: &str, file: &Path) -> Json {
    let py = std::env::var_os("CKPT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let out = Command::new(&py)
        .arg(root().join("tests/python/interop_helper.py"))
        .arg(cmd)
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set CKPT_PYTHON): {e}", py.display()));
    assert!(
        out.status.success(),
        "{cmd} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("helper prints JSON")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The helper's description of a value whose tensors are looked up by name.
fn describe(v: &Value, tensors: &HashMap<&str, &Tensor>) -> Json {
    match v {
        Value::Null => json!({"t": "none"}),
        Value::Bool(b) => json!({"t": "bool", "v": b}),
        Value::Int(i) => json!({"t": "int", "v": i}),
        Value::Float(f) => json!({"t": "float", "bits": f.to_bits()}),
        Value::Str(s) => json!({"t": "str", "v": s}),
        Value::Bytes(b) => json!({"t": "bytes", "hex": hex(b)}),
        Value::List(items) => {
            json!({"t": "list", "items": items.iter().map(|x| describe(x, tensors)).collect::<Vec<_>>()})
        }
        Value::Tuple(items) => {
            json!({"t": "tuple", "items": items.iter().map(|x| describe(x, tensors)).collect::<Vec<_>>()})
        }
        Value::Map(entries) => json!({"t": "dict", "items": entries.iter().map(|(k, v)| {
            let k = match k { Key::Int(i) => json!({"t": "int", "v": i}), Key::Str(s) => json!({"t": "str", "v": s}) };
            json!([k, describe(v, tensors)])
        }).collect::<Vec<_>>()}),
        Value::Tensor(name) => {
            let t = tensors[name.as_str()];
            json!({"t": "tensor", "dtype": dtypes::torch_name(t.dtype).expect("torch dtype"), "shape": t.shape, "hex": hex(&t.data)})
        }
    }
}

/// Describe a state as the `.pt` file holding it.
fn describe_state(s: &State) -> Json {
    let by_name: HashMap<&str, &Tensor> = s.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    describe(&tree::root_of(s), &by_name)
}

/// A dict description as a map keyed by string keys (safetensors has no order).
fn by_key(d: &Json) -> BTreeMap<String, Json> {
    d["items"]
        .as_array()
        .expect("dict")
        .iter()
        .map(|kv| {
            (
                kv[0]["v"].as_str().expect("str key").to_owned(),
                kv[1].clone(),
            )
        })
        .collect()
}

const TORCH_DTYPES: [DType; 19] = [
    DType::F64,
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U8,
    DType::BOOL,
    DType::C64,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::F8_E5M2,
    DType::F8_E4M3,
    DType::F8_E5M2FNUZ,
    DType::F8_E4M3FNUZ,
    DType::F8_E8M0,
];

/// Every dtype in `dtypes` (BOOL as 0/1), an empty and a 0-d tensor, nested names.
fn state_of(dtypes: &[DType]) -> State {
    let mut s = State::new();
    for (i, d) in dtypes.iter().enumerate() {
        let mut t = tensor(
            &format!("layers.{i}.{}", d.name()),
            *d,
            &[2, 3],
            i as u64 + 1,
        );
        if *d == DType::BOOL {
            t.data = t.data.iter().map(|b| b & 1).collect::<Vec<u8>>().into();
        }
        s = s.with_tensor(t);
    }
    s.with_tensor(tensor("model.empty", DType::F32, &[0, 4], 9))
        .with_tensor(tensor("model.scalar", DType::F64, &[], 10))
}

fn nested_state() -> State {
    let mut s = state_of(&TORCH_DTYPES);
    let names: Vec<(Key, Value)> = s
        .tensors
        .iter()
        .map(|t| (Key::from(t.name.as_str()), Value::Tensor(t.name.clone())))
        .collect();
    s.meta = Value::map([
        ("model", Value::Map(names)),
        (
            "optimizer",
            Value::map([
                (
                    "state",
                    Value::Map(vec![(
                        Key::Int(0),
                        Value::map([("exp_avg", Value::Tensor("model.empty".into()))]),
                    )]),
                ),
                (
                    "param_groups",
                    Value::List(vec![Value::map([
                        ("lr", Value::Float(1e-3)),
                        (
                            "betas",
                            Value::Tuple(vec![Value::Float(0.9), Value::Float(f64::NAN)]),
                        ),
                        (
                            "params",
                            Value::List(vec![Value::Int(0), Value::Int(-(1 << 40))]),
                        ),
                        ("blob", Value::Bytes(vec![0, 128, 255])),
                        ("none", Value::Null),
                        ("amsgrad", Value::Bool(false)),
                    ])]),
                ),
            ]),
        ),
        ("epoch", Value::Int(3)),
    ]);
    s
}

#[test]
fn pt_we_write_opens_in_torch_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    for (i, s) in [nested_state(), state_of(&TORCH_DTYPES)].iter().enumerate() {
        let file = dir.path().join(format!("s{i}.pt"));
        std::fs::write(&file, ckpt_formats::torch::write_pt(s).unwrap()).unwrap();
        assert_eq!(python("describe-pt", &file), describe_state(s), "state {i}");
    }
}

#[test]
fn pt_torch_save_reads_here_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("torch.pt");
    let want = python("make-pt", &file);
    let state = ckpt_formats::torch::read_pt(&Bytes::from(std::fs::read(&file).unwrap())).unwrap();
    assert_eq!(describe_state(&state), want);
    // Views come back materialized: the transposed one differs from its storage order.
    let t = state.tensor("extra.transposed").expect("named by path");
    assert_eq!(t.shape, vec![4, 3]);
    let first: Vec<f32> = t
        .data
        .chunks(4)
        .take(3)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(first, vec![0.0, 4.0, 8.0]);
}

#[test]
fn pt_with_code_in_its_pickle_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("evil.pt");
    python("make-evil-pt", &file);
    let err = ckpt_formats::torch::read_pt(&Bytes::from(std::fs::read(&file).unwrap()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("refused") && err.contains("system"), "{err}");
    assert!(!dir.path().join("evil.pt.pwned").exists());
}

#[tokio::test]
async fn engine_checkpoints_open_in_their_readers() {
    for format in ["torch", "safetensors"] {
        let dir = tempfile::tempdir().unwrap();
        let cp = ckpt_formats::builder(dir.path().to_str().unwrap())
            .format(ckpt_formats::by_name(format).unwrap())
            .build()
            .await
            .unwrap();
        let dts: &[DType] = if format == "torch" {
            &TORCH_DTYPES
        } else {
            ST_DTYPES
        };
        let state = state_of(dts).with_meta(Value::map([("step", Value::Int(5))]));
        let report = cp.save(5, &state).await.unwrap().wait().await.unwrap();
        let loaded = cp.load_latest().await.unwrap().unwrap();
        assert_eq!(loaded.state, state, "{format}");
        assert_eq!(loaded.manifest.format, format);
        let data = dir
            .path()
            .join("data")
            .join(ckpt_core::layout::checkpoint_name(&report.id));
        let flat = State {
            tensors: state.tensors.clone(),
            meta: Value::Null,
        };
        if format == "torch" {
            // A single-process checkpoint keeps the non-tensor state in the .pt too,
            // as torch.save(state_dict) would.
            assert_eq!(
                python("describe-pt", &data.join("model-rank00000.pt")),
                describe_state(&state)
            );
        } else {
            let got = python("describe-st", &data.join("model-rank00000.safetensors"));
            assert_eq!(by_key(&got["tensors"]), by_key(&describe_state(&flat)));
            let index: Json = serde_json::from_slice(
                &std::fs::read(data.join("model.safetensors.index.json")).unwrap(),
            )
            .unwrap();
            assert_eq!(
                index["weight_map"]["model.scalar"],
                "model-rank00000.safetensors"
            );
            assert_eq!(index["metadata"]["total_size"], state.nbytes());
        }
    }
}

/// What `safetensors.torch` can hold: the torch dtypes but F8_E8M0 (the last one);
/// it has no F4 or F6 tensors either.
const ST_DTYPES: &[DType] = TORCH_DTYPES.split_last().expect("non-empty").1;

#[test]
fn safetensors_we_write_open_in_safetensors_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.safetensors");
    let state = state_of(ST_DTYPES).with_meta(Value::map([("epoch", Value::Int(2))]));
    std::fs::write(
        &file,
        ckpt_formats::safetensors::codec::encode(&state).unwrap(),
    )
    .unwrap();
    let got = python("describe-st", &file);
    let flat = State {
        tensors: state.tensors.clone(),
        meta: Value::Null,
    };
    assert_eq!(by_key(&got["tensors"]), by_key(&describe_state(&flat)));
    assert_eq!(got["metadata"]["format"], "pt");
    let meta: Value = serde_json::from_str(got["metadata"]["ckpt.meta"].as_str().unwrap()).unwrap();
    assert_eq!(meta, state.meta);
}

#[test]
fn safetensors_save_file_reads_here_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("py.safetensors");
    let want = python("make-st", &file);
    let state =
        ckpt_formats::safetensors::read_file(&Bytes::from(std::fs::read(&file).unwrap())).unwrap();
    assert_eq!(state.meta, Value::Null);
    assert_eq!(by_key(&describe_state(&state)), by_key(&want["tensors"]));
    assert_eq!(state.tensor("scalar").unwrap().shape, Vec::<u64>::new());
}
