//! The Python baselines (`evaluator/python/baselines.py`), run as a subprocess on
//! exactly the tensors ckpt saves: the state is written once as a JSON spec and a
//! binary blob, and the script prints its timings as JSON.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckpt_core::State;
use serde_json::Value as Json;

/// The baseline script, embedded so the binary works from any directory.
pub const SCRIPT: &str = include_str!("../python/baselines.py");

/// The Python interpreter: `$CKPT_PYTHON`, else `.venv/bin/python` of the repo.
pub fn interpreter() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CKPT_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        repo.join(".venv/bin/python"),
        PathBuf::from(".venv/bin/python"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// A file of the source tree this binary was built from (`relative` to
/// `evaluator/`), or the path the environment variable `env` gives instead.
pub fn source_path(env: &str, relative: &str) -> PathBuf {
    std::env::var_os(env).map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join(relative),
        PathBuf::from,
    )
}

/// The peers, floors, cache dropping and memory sampling every Python
/// benchmark script imports (`peers.py`), written next to each.
pub const PEERS: &str = include_str!("../python/peers.py");

/// Write a Python benchmark script and the module it imports into `dir`;
/// returns the script's path.
pub fn write_bench_script(dir: &Path, name: &str, script: &str) -> std::io::Result<PathBuf> {
    std::fs::write(dir.join("peers.py"), PEERS)?;
    let path = dir.join(name);
    std::fs::write(&path, script)?;
    Ok(path)
}

/// A state written for the script: where the spec, blob and script live.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The JSON spec.
    pub spec: PathBuf,
    /// The raw bytes of every tensor, back to back.
    pub blob: PathBuf,
    /// The script.
    pub script: PathBuf,
    /// Scratch directory for the script's checkpoints.
    pub work: PathBuf,
}

/// Write `state` (spec + blob) and the script under `dir`.
pub fn export(state: &State, dir: &Path) -> std::io::Result<Exported> {
    std::fs::create_dir_all(dir)?;
    let blob = dir.join("state.bin");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&blob)?);
    let mut offset = 0u64;
    let mut tensors = Vec::new();
    for t in &state.tensors {
        f.write_all(&t.data)?;
        tensors.push(serde_json::json!({
            "name": t.name,
            "dtype": format!("{:?}", t.dtype),
            "shape": t.shape,
            "offset": offset,
            "nbytes": t.data.len(),
        }));
        offset += t.data.len() as u64;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    let spec = dir.join("spec.json");
    std::fs::write(
        &spec,
        serde_json::to_vec(&serde_json::json!({ "tensors": tensors }))?,
    )?;
    let script = write_bench_script(dir, "baselines.py", SCRIPT)?;
    let work = dir.join("py");
    std::fs::create_dir_all(&work)?;
    Ok(Exported {
        spec,
        blob,
        script,
        work,
    })
}

/// Run the script with `args` after the common ones; returns its JSON output.
pub fn run(python: &Path, e: &Exported, what: &str, args: &[String]) -> Result<Json, String> {
    let out = Command::new(python)
        .arg(&e.script)
        .arg(what)
        .arg("--spec")
        .arg(&e.spec)
        .arg("--blob")
        .arg(&e.blob)
        .arg("--dir")
        .arg(&e.work)
        .args(args)
        .output()
        .map_err(|err| format!("cannot run {}: {err}", python.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: String = stderr
            .lines()
            .rev()
            .take(8)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(format!(
            "baselines.py {what} failed ({}):\n{tail}",
            out.status
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or("baselines.py printed no JSON")?;
    serde_json::from_str(line).map_err(|err| format!("baselines.py output: {err}"))
}

/// Numbers of a JSON array field (empty if absent).
pub fn floats(v: &Json, key: &str) -> Vec<f64> {
    v.get(key)
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_f64).collect())
        .unwrap_or_default()
}

/// The summary of the numbers under `key`, if there are any.
pub fn summary(v: &Json, key: &str) -> Option<crate::stats::Summary> {
    let f = floats(v, key);
    (!f.is_empty()).then(|| crate::stats::Summary::of(&f))
}

/// Read a state written as a spec + blob (by [`export`] or by the script).
pub fn import(spec: &Path, blob: &Path) -> Result<State, String> {
    let spec: Json = serde_json::from_slice(&std::fs::read(spec).map_err(|e| e.to_string())?)
        .map_err(|e| format!("spec: {e}"))?;
    let blob = std::fs::read(blob).map_err(|e| e.to_string())?;
    let mut state = State::new();
    for t in spec["tensors"].as_array().ok_or("spec without tensors")? {
        let name = t["name"].as_str().ok_or("tensor without a name")?;
        let dtype = match t["dtype"].as_str() {
            Some("F32") => ckpt_core::DType::F32,
            Some("F64") => ckpt_core::DType::F64,
            Some("F16") => ckpt_core::DType::F16,
            Some("BF16") => ckpt_core::DType::BF16,
            Some("I64") => ckpt_core::DType::I64,
            Some("I32") => ckpt_core::DType::I32,
            Some("U8") => ckpt_core::DType::U8,
            other => return Err(format!("{name}: dtype {other:?} not handled")),
        };
        let shape: Vec<u64> = t["shape"]
            .as_array()
            .ok_or("tensor without a shape")?
            .iter()
            .map(|d| d.as_u64().ok_or("bad dimension"))
            .collect::<Result<_, _>>()?;
        let (off, len) = (
            t["offset"].as_u64().ok_or("no offset")? as usize,
            t["nbytes"].as_u64().ok_or("no length")? as usize,
        );
        let bytes = blob
            .get(off..off.checked_add(len).ok_or("overflow")?)
            .ok_or_else(|| format!("{name}: outside the blob"))?;
        let tensor =
            ckpt_core::Tensor::new(name, dtype, shape, bytes::Bytes::copy_from_slice(bytes))
                .map_err(|e| e.to_string())?;
        state = state.with_tensor(tensor);
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_then_import_is_the_same_state() {
        let dir = tempfile::tempdir().unwrap();
        let state = crate::models::ModelState {
            model: "resnet50".into(),
            bytes: 1 << 20,
            mix: crate::models::DtypeMix::Bf16,
            optimizer: true,
            seed: 4,
        }
        .build()
        .unwrap();
        let e = export(&state, dir.path()).unwrap();
        assert_eq!(import(&e.spec, &e.blob).unwrap(), state);
        std::fs::write(&e.blob, b"short").unwrap();
        assert!(
            import(&e.spec, &e.blob).is_err(),
            "a truncated blob is refused"
        );
    }
}
