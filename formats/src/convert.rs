//! `ckpt convert`: copy a checkpoint into another format, bit for bit.
//!
//! A source is a checkpoint root (a URL or path; its newest intact checkpoint, or
//! a given step) or a plain file written by anything (`.pt`/`.pth`/`.bin` through
//! [`crate::torch::read_pt`], `.safetensors` through [`crate::safetensors::read_file`],
//! `.h5`/`.hdf5` through `crate::hdf5::read_h5` with the `hdf5` feature).
//! A destination is a checkpoint root, written through the engine in the chosen
//! format at the source's step, or a plain `.pt` / `.safetensors` file, which then
//! carries the non-tensor state too.

use std::path::Path;

use bytes::Bytes;
use ckpt_core::{Error, Result, State};

/// Options of a conversion.
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Format of the destination checkpoint (`native`, `safetensors`, `torch`, ...);
    /// ignored for a destination file, whose extension decides.
    pub format: String,
    /// Step to convert (default: the newest intact checkpoint; 0 for a plain file).
    pub step: Option<u64>,
}

/// What a conversion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertReport {
    /// Step written.
    pub step: u64,
    /// Format written.
    pub format: String,
    /// Tensors copied.
    pub tensors: usize,
    /// Raw tensor bytes copied.
    pub bytes: u64,
}

/// The kind of plain file a path names, by extension.
fn file_kind(path: &str) -> Option<&'static str> {
    let ext = Path::new(path).extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "pt" | "pth" | "bin" => Some("torch"),
        "safetensors" => Some("safetensors"),
        #[cfg(feature = "hdf5")]
        "h5" | "hdf5" => Some("hdf5"),
        _ => None,
    }
}

/// Read a plain file into a state.
pub fn read_plain_file(path: &str) -> Result<State> {
    let kind = file_kind(path)
        .ok_or_else(|| Error::InvalidInput(format!("`{path}`: unknown file type")))?;
    #[cfg(feature = "hdf5")]
    if kind == "hdf5" {
        return crate::hdf5::read_h5(Path::new(path)).map_err(|e| e.into_corrupt(path));
    }
    let bytes = Bytes::from(std::fs::read(path)?);
    match kind {
        "torch" => crate::torch::read_pt(&bytes),
        _ => crate::safetensors::read_file(&bytes),
    }
    .map_err(|e| e.into_corrupt(path, None))
}

/// Load the source: a plain file, or a checkpoint of a root. Returns the step too.
pub async fn load_source(src: &str, step: Option<u64>) -> Result<(u64, State)> {
    if file_kind(src).is_some() && !src.contains("://") {
        if !Path::new(src).is_file() {
            return Err(Error::NotFound {
                what: format!("file `{src}`"),
            });
        }
        return Ok((step.unwrap_or(0), read_plain_file(src)?));
    }
    let cp = crate::builder(src).read_only().build().await?;
    let loaded = match step {
        Some(s) => cp.load_step(s).await?,
        None => cp.load_latest().await?.ok_or_else(|| Error::NotFound {
            what: format!("an intact checkpoint under `{src}`"),
        })?,
    };
    Ok((loaded.id.step, loaded.state))
}

/// Convert `src` into `dst` (see the module docs).
pub async fn convert(src: &str, dst: &str, opts: &ConvertOptions) -> Result<ConvertReport> {
    let (step, state) = load_source(src, opts.step).await?;
    let report = |format: &str| ConvertReport {
        step,
        format: format.to_owned(),
        tensors: state.tensors.len(),
        bytes: state.nbytes(),
    };
    if let Some(kind) = file_kind(dst) {
        if Path::new(dst).exists() {
            return Err(Error::Conflict(format!(
                "`{dst}` exists; not overwriting it"
            )));
        }
        let bytes = match kind {
            "torch" => crate::torch::write_pt(&state),
            #[cfg(feature = "hdf5")]
            "hdf5" => crate::hdf5::encode(&state).map_err(crate::CodecError::from),
            _ => crate::safetensors::codec::encode(&state),
        }
        .map_err(|e| Error::InvalidInput(format!("cannot write `{dst}`: {e}")))?;
        let tmp = format!("{dst}.partial");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, dst)?;
        return Ok(report(kind));
    }
    let format = crate::by_name(&opts.format)?;
    let cp = crate::builder(dst).format(format).build().await?;
    cp.save(step, &state).await?.wait().await?;
    Ok(report(&opts.format))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_core::{DType, Key, Tensor, Value};

    /// Tensor names are their key paths, which a `.pt` file (it stores no names) keeps.
    fn state() -> State {
        State::new()
            .with_tensor(Tensor::from_f32("model.w", vec![2], &[1.0, f32::NAN]).unwrap())
            .with_tensor(Tensor::new("opt.0", DType::BF16, vec![], vec![3u8, 4]).unwrap())
            .with_tensor(Tensor::new("empty", DType::I8, vec![0], Vec::new()).unwrap())
            .with_meta(Value::map([
                (
                    "model",
                    Value::map([("w", Value::Tensor("model.w".into()))]),
                ),
                (
                    "opt",
                    Value::Map(vec![(Key::Int(0), Value::Tensor("opt.0".into()))]),
                ),
                ("empty", Value::Tensor("empty".into())),
                ("step", Value::Int(9)),
            ]))
    }

    #[tokio::test]
    async fn native_to_each_format_and_back_is_bitwise_identical() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let src = src.to_str().unwrap();
        let cp = crate::builder(src).build().await.unwrap();
        cp.save(42, &state()).await.unwrap().wait().await.unwrap();
        for format in crate::registry().names() {
            let mid = dir.path().join(format!("mid-{format}"));
            let back = dir.path().join(format!("back-{format}"));
            let opts = ConvertOptions {
                format: format.to_owned(),
                step: None,
            };
            let r = convert(src, mid.to_str().unwrap(), &opts).await.unwrap();
            assert_eq!((r.step, r.tensors), (42, 3));
            let native = ConvertOptions {
                format: "native".into(),
                step: Some(42),
            };
            convert(mid.to_str().unwrap(), back.to_str().unwrap(), &native)
                .await
                .unwrap();
            let (step, got) = load_source(back.to_str().unwrap(), None).await.unwrap();
            assert_eq!((step, got), (42, state()), "via {format}");
        }
    }

    #[tokio::test]
    async fn plain_files_round_trip_and_are_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        crate::builder(src.to_str().unwrap())
            .build()
            .await
            .unwrap()
            .save(1, &state())
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        #[allow(unused_mut)]
        let mut files = vec!["x.pt", "x.safetensors"];
        #[cfg(feature = "hdf5")]
        files.push("x.h5");
        for file in files {
            let f = dir.path().join(file);
            let f = f.to_str().unwrap();
            convert(src.to_str().unwrap(), f, &ConvertOptions::default())
                .await
                .unwrap();
            assert_eq!(read_plain_file(f).unwrap(), state(), "{file}");
            let again = convert(src.to_str().unwrap(), f, &ConvertOptions::default()).await;
            assert!(matches!(again, Err(Error::Conflict(_))));
        }
    }
}
