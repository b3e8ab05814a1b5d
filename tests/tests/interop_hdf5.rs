//! Interop of the HDF5 format with h5py (the project's venv, through
//! `tests/python/interop_hdf5_helper.py`): files we write open in h5py bit for
//! bit (the bf16/fp8 convention through the documented torch view), files h5py
//! writes load here bit for bit, what we do not import is refused with a typed
//! error, and engine checkpoints in the `hdf5` format round-trip on file and
//! memory stores and through `ckpt convert`.
//!
//! Python is `$CKPT_PYTHON`, or `.venv/bin/python` under the workspace root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_core::{DType, Layout, State, Tensor, Value};
use ckpt_formats::convert::{convert, load_source, ConvertOptions};
use ckpt_formats::hdf5::names::{place_all, Place};
use ckpt_formats::hdf5::{encode, read_h5, H5Error};
use ckpt_tests::{assert_same, every_dtype_state, sample_meta, tensor};
use serde_json::Value as Json;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn python(args: &[&str], file: &Path) -> Json {
    let py = std::env::var_os("CKPT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let out = Command::new(&py)
        .arg(root().join("tests/python/interop_hdf5_helper.py"))
        .arg(args[0])
        .arg(file)
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set CKPT_PYTHON): {e}", py.display()));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("helper prints JSON")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The numpy dtype h5py gives a dataset holding `d`.
fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::BOOL => "bool",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U16 | DType::BF16 => "uint16",
        DType::U32 => "uint32",
        DType::U64 => "uint64",
        DType::F16 => "float16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::C64 => "complex64",
        _ => "uint8",
    }
}

/// Every dtype (BOOL as 0/1), empty and 0-d tensors, nested names and names that
/// are not paths (a dataset and a group at once, a `/`, empty parts).
fn state() -> State {
    let mut s = every_dtype_state(11);
    for t in &mut s.tensors {
        if t.dtype == DType::BOOL {
            t.data = t.data.iter().map(|b| b & 1).collect::<Vec<u8>>().into();
        }
    }
    s.with_tensor(tensor("model.layers.0.weight", DType::BF16, &[2, 3], 1))
        .with_tensor(tensor("model.layers.0", DType::F32, &[2], 2))
        .with_tensor(tensor("odd/name", DType::I16, &[3], 3))
        .with_tensor(tensor("a..b", DType::F8_E4M3, &[], 4))
        .with_tensor(tensor("empty.scalar0", DType::U8, &[0], 5))
}

/// Check what h5py saw in a file holding `s` (its meta too, unless `meta` is false).
fn check_described(got: &Json, s: &State, meta: bool) {
    let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
    let places = place_all(&names).unwrap();
    let datasets = got["datasets"].as_object().expect("datasets");
    assert_eq!(datasets.len(), s.tensors.len());
    for (i, (t, place)) in s.tensors.iter().zip(&places).enumerate() {
        let d = &datasets[&place.path()];
        let packed = matches!(t.dtype, DType::F4 | DType::F6_E2M3 | DType::F6_E3M2);
        let shape = if packed {
            vec![t.data.len() as u64]
        } else {
            t.shape.clone()
        };
        assert_eq!(d["dtype"], numpy_name(t.dtype), "{}", t.name);
        assert_eq!(d["shape"], serde_json::json!(shape), "{}", t.name);
        assert_eq!(d["hex"], hex(&t.data), "{}", t.name);
        assert_eq!(d["attrs"]["ckpt_dtype"], t.dtype.name(), "{}", t.name);
        assert_eq!(d["attrs"]["ckpt_index"], i, "{}", t.name);
        if packed {
            assert_eq!(d["attrs"]["ckpt_shape"], serde_json::json!(t.shape));
        }
        match place {
            Place::Flat(_) => assert_eq!(d["attrs"]["ckpt_name"], t.name.as_str()),
            Place::Path(_) => assert!(d["attrs"].get("ckpt_name").is_none()),
        }
        if t.dtype == DType::BF16 || t.dtype.name().starts_with("F8_") {
            // The documented recipe: torch.from_numpy(a).view(torch.<dtype>).
            assert_eq!(d["torch_hex"], hex(&t.data), "{}", t.name);
        }
    }
    if meta {
        let m: Value = serde_json::from_str(got["meta"].as_str().expect("ckpt_meta")).unwrap();
        // By their JSON: the meta holds a NaN, which is not equal to itself.
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            serde_json::to_string(&s.meta).unwrap()
        );
    } else {
        assert!(got["meta"].is_null());
    }
}

#[test]
fn h5_we_write_opens_in_h5py_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.h5");
    let s = state();
    std::fs::write(&file, encode(&s).unwrap()).unwrap();
    let got = python(&["describe-h5"], &file);
    check_described(&got, &s, true);
    let places = place_all(&["model.layers.0.weight", "model", "opt.state.0.exp_avg"]).unwrap();
    assert_eq!(places[0].path(), "model/layers.0.weight");
    assert_eq!(places[1].path(), "ckpt.flat/model");
    assert_eq!(places[2].path(), "opt/state.0.exp_avg");
    // And back here, in order.
    assert_same(&read_h5(&file).unwrap(), &s);
}

#[test]
fn h5py_files_read_here_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("py.h5");
    let want = python(&["make-h5"], &file);
    let s = read_h5(&file).unwrap();
    assert_eq!(s.meta, Value::Null);
    let got: BTreeMap<String, Json> = s
        .tensors
        .iter()
        .map(|t| {
            let dtype = match t.dtype {
                DType::BF16 => "bf16",
                d => numpy_name(d),
            };
            (
                t.name.clone(),
                serde_json::json!({"dtype": dtype, "shape": t.shape, "hex": hex(&t.data)}),
            )
        })
        .collect();
    let want: BTreeMap<String, Json> = want
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(got, want);
    assert_eq!(s.tensor("scalar").unwrap().shape, Vec::<u64>::new());
    // No ckpt_index: path order.
    let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted);
}

#[test]
fn what_we_do_not_import_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for kind in ["string", "soft", "external", "enum", "vlen"] {
        let file = dir.path().join(format!("{kind}.h5"));
        python(&["make-bad-h5", kind], &file);
        match read_h5(&file) {
            Err(H5Error::Unsupported(m)) => assert!(!m.is_empty(), "{kind}"),
            other => panic!("{kind}: {other:?}"),
        }
        // Through convert too, as a typed corruption error.
        let err = load_source(file.to_str().unwrap(), None).await_blocking();
        assert!(
            matches!(err, Err(ckpt_core::Error::Corrupt { .. })),
            "{kind}: {err:?}"
        );
    }
}

trait Blocking {
    type Out;
    fn await_blocking(self) -> Self::Out;
}

impl<F: std::future::Future> Blocking for F {
    type Out = F::Output;
    fn await_blocking(self) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(self)
    }
}

#[tokio::test]
async fn engine_checkpoints_round_trip_on_file_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let file_url = format!("file://{}", dir.path().join("ck").display());
    let mem_url = ckpt_tests::memory_root("interop-hdf5");
    for url in [file_url.as_str(), mem_url.as_str()] {
        let cp = ckpt_formats::builder(url)
            .format(ckpt_formats::by_name("hdf5").unwrap())
            .build()
            .await
            .unwrap();
        let s = state().with_meta(sample_meta());
        cp.save(3, &s).await.unwrap().wait().await.unwrap();
        let loaded = cp.load_latest().await.unwrap().unwrap();
        assert_same(&loaded.state, &s);
        assert_eq!(loaded.manifest.format, "hdf5");
        let mut objects = std::collections::BTreeSet::new();
        for r in &loaded.manifest.tensors {
            let Layout::Range { object, len, .. } = &r.layout else {
                panic!("{}: not a range", r.name)
            };
            assert!(object.ends_with("/model-rank00000.h5"), "{object}");
            assert_eq!(*len, s.tensor(&r.name).unwrap().data.len() as u64);
            objects.insert(object.clone());
        }
        assert_eq!(objects.len(), 1);
        if url == file_url {
            let path = dir.path().join("ck").join(objects.first().unwrap());
            check_described(&python(&["describe-h5"], &path), &s, true);
            // Damage one tensor's bytes: that checkpoint is skipped, not loaded.
            let r = loaded
                .manifest
                .tensors
                .iter()
                .find(|r| r.name == "model.scalar")
                .unwrap();
            let Layout::Range { offset, .. } = r.layout else {
                unreachable!()
            };
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[offset as usize] ^= 0xff;
            std::fs::write(&path, bytes).unwrap();
            let err = cp.load_step(3).await.unwrap_err();
            assert!(matches!(err, ckpt_core::Error::Corrupt { .. }), "{err}");
        }
    }
}

#[tokio::test]
async fn convert_native_to_hdf5_and_back_is_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let s = state().with_meta(sample_meta());
    let cp = ckpt_formats::builder(src.to_str().unwrap())
        .build()
        .await
        .unwrap();
    cp.save(7, &s).await.unwrap().wait().await.unwrap();
    let native = |step| ConvertOptions {
        format: "native".into(),
        step,
    };
    // Through a plain .h5 file (h5py reads it, meta included).
    let h5 = dir.path().join("x.h5");
    convert(src.to_str().unwrap(), h5.to_str().unwrap(), &native(None))
        .await
        .unwrap();
    check_described(&python(&["describe-h5"], &h5), &s, true);
    let back = dir.path().join("back");
    let r = convert(
        h5.to_str().unwrap(),
        back.to_str().unwrap(),
        &native(Some(7)),
    )
    .await
    .unwrap();
    assert_eq!(r.tensors, s.tensors.len());
    let (step, got) = load_source(back.to_str().unwrap(), None).await.unwrap();
    assert_eq!(step, 7);
    assert_same(&got, &s);
    // Through an hdf5-format checkpoint.
    let mid = dir.path().join("mid");
    let hdf5 = ConvertOptions {
        format: "hdf5".into(),
        step: None,
    };
    convert(src.to_str().unwrap(), mid.to_str().unwrap(), &hdf5)
        .await
        .unwrap();
    let back2 = dir.path().join("back2");
    convert(
        mid.to_str().unwrap(),
        back2.to_str().unwrap(),
        &native(None),
    )
    .await
    .unwrap();
    let (step, got) = load_source(back2.to_str().unwrap(), None).await.unwrap();
    assert_eq!(step, 7);
    assert_same(&got, &s);
}

#[test]
fn tensors_ckpt_cannot_store_as_paths_still_round_trip() {
    let s = State::new()
        .with_tensor(Tensor::new(".", DType::U8, vec![1], vec![1u8]).unwrap())
        .with_tensor(Tensor::new("%2E", DType::U8, vec![1], vec![2u8]).unwrap())
        .with_tensor(Tensor::new("a.", DType::U8, vec![1], vec![3u8]).unwrap())
        .with_tensor(Tensor::new("a", DType::U8, vec![1], vec![4u8]).unwrap());
    assert_eq!(read_h5(&encode(&s).unwrap()).unwrap(), s);
}
