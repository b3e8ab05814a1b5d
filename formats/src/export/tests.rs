//! Exports of a state laid out as the Python package saves it.

use bytes::Bytes;
use ckpt_core::{DType, Key, State, Tensor, Value};

use super::*;

/// `save(7, model=m, optimizer=o)` with RNG, as the Python package stores it.
fn python_state() -> State {
    let odict = |items: Value| {
        Value::map([
            ("__ckpt__", Value::Str("odict".into())),
            ("items", items),
            ("metadata", Value::Null),
        ])
    };
    let local = Value::map([(
        "tree",
        Value::map([(
            "rng",
            Value::map([("torch", Value::Tensor("__rank0__.rng.torch".into()))]),
        )]),
    )]);
    let blob = serde_json::to_vec(&local).unwrap();
    State::new()
        .with_tensor(Tensor::from_f32("model.a.weight", vec![2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap())
        .with_tensor(Tensor::from_f32("model.b.bias", vec![3], &[0.5, -1.5, 1e-3]).unwrap())
        .with_tensor(
            Tensor::new(
                "model.steps",
                DType::I64,
                vec![],
                vec![5u8, 0, 0, 0, 0, 0, 0, 0],
            )
            .unwrap(),
        )
        .with_tensor(Tensor::from_f32("optimizer.state.0.exp_avg", vec![1], &[9.0]).unwrap())
        .with_tensor(Tensor::new("__rank0__.rng.torch", DType::U8, vec![2], vec![1u8, 2]).unwrap())
        .with_tensor(Tensor::new("__rank0__", DType::U8, vec![blob.len() as u64], blob).unwrap())
        .with_meta(Value::map([
            ("ckpt", Value::map([("version", Value::Int(1))])),
            (
                "state",
                Value::map([
                    (
                        "model",
                        odict(Value::map([
                            ("a.weight", Value::Tensor("model.a.weight".into())),
                            ("b.bias", Value::Tensor("model.b.bias".into())),
                            ("steps", Value::Tensor("model.steps".into())),
                        ])),
                    ),
                    (
                        "optimizer",
                        Value::map([(
                            "state",
                            Value::Map(vec![(
                                Key::Int(0),
                                Value::map([(
                                    "exp_avg",
                                    Value::Tensor("optimizer.state.0.exp_avg".into()),
                                )]),
                            )]),
                        )]),
                    ),
                    ("extra", Value::map([("epoch", Value::Int(2))])),
                ]),
            ),
        ]))
}

async fn saved(dir: &Path, format: &str) -> String {
    let url = dir.join(format!("ck-{format}"));
    let url = url.to_str().unwrap().to_owned();
    let cp = crate::builder(url.as_str())
        .format(crate::by_name(format).unwrap())
        .build()
        .await
        .unwrap();
    cp.save(7, &python_state())
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    url
}

fn read(path: &Path) -> State {
    crate::safetensors::read_file(&Bytes::from(std::fs::read(path).unwrap())).unwrap()
}

fn names(s: &State) -> Vec<&str> {
    s.tensors.iter().map(|t| t.name.as_str()).collect()
}

#[tokio::test]
async fn exports_one_entry_without_internals_from_every_format() {
    let dir = tempfile::tempdir().unwrap();
    for format in ["native", "safetensors", "torch"] {
        let url = saved(dir.path(), format).await;
        let out = dir.path().join(format!("{format}.safetensors"));
        let r = export(&url, &out, &ExportOptions::new("model"))
            .await
            .unwrap();
        assert_eq!((r.step, r.tensors, r.bytes), (7, 3, 36));
        let s = read(&out);
        assert_eq!(names(&s), ["a.weight", "b.bias", "steps"], "{format}");
        assert_eq!(
            s.tensors[1],
            Tensor::from_f32("b.bias", vec![3], &[0.5, -1.5, 1e-3]).unwrap()
        );
        // Never overwritten.
        let again = export(&url, &out, &ExportOptions::new("model")).await;
        assert!(matches!(again, Err(Error::Conflict(_))), "{again:?}");
    }
}

#[tokio::test]
async fn a_missing_entry_lists_the_entries_there_are() {
    let dir = tempfile::tempdir().unwrap();
    let url = saved(dir.path(), "native").await;
    let err = export(
        &url,
        &dir.path().join("x.safetensors"),
        &ExportOptions::new("modle"),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("modle") && msg.contains("model, optimizer"),
        "{msg}"
    );
    assert!(
        !msg.contains("__rank0__") && !msg.contains("extra"),
        "{msg}"
    );
}

#[tokio::test]
async fn hf_layout_shards_with_an_index_and_casts_floats() {
    let dir = tempfile::tempdir().unwrap();
    let url = saved(dir.path(), "native").await;
    let out = dir.path().join("hf");
    let opts = ExportOptions {
        hf: true,
        dtype: Some(DType::BF16),
        max_shard_bytes: 8,
        ..ExportOptions::new("model")
    };
    let r = export(&url, &out, &opts).await.unwrap();
    let files: Vec<String> = r
        .files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        files,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["total_size"], 8 + 6 + 8);
    assert_eq!(
        index["weight_map"]["b.bias"],
        "model-00002-of-00003.safetensors"
    );
    let a = read(&out.join("model-00001-of-00003.safetensors"));
    assert_eq!(a.tensors[0].dtype, DType::BF16);
    assert_eq!(
        a.tensors[0].data.as_ref(),
        [0x80, 0x3f, 0, 0x40, 0x40, 0x40, 0x80, 0x40]
    );
    let steps = read(&out.join("model-00003-of-00003.safetensors"));
    assert_eq!(steps.tensors[0].dtype, DType::I64, "integers are not cast");

    // One file when everything fits, and a .pt holding a flat state dict.
    let one = dir.path().join("hf1");
    export(
        &url,
        &one,
        &ExportOptions {
            hf: true,
            ..ExportOptions::new("optimizer")
        },
    )
    .await
    .unwrap();
    assert_eq!(
        names(&read(&one.join("model.safetensors"))),
        ["state.0.exp_avg"]
    );
    let pt = dir.path().join("m.pt");
    let opts = ExportOptions {
        format: ExportFormat::Pt,
        ..ExportOptions::new("model")
    };
    export(&url, &pt, &opts).await.unwrap();
    let s = crate::torch::read_pt(&Bytes::from(std::fs::read(&pt).unwrap())).unwrap();
    assert_eq!(names(&s), ["a.weight", "b.bias", "steps"]);
    assert_eq!(s.meta, Value::Null);
}
