//! Running the Python benchmark scripts (written out by
//! [`crate::python::write_bench_script`]): whether they can run here, and a
//! run under a time limit in a process group of its own.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Error;

/// Every module some experiment asks [`python_missing`] for: the first call
/// imports them all in one interpreter (about 5 s on 2 cores, most of it
/// torch's import), and later calls answer from what it found. One probe per
/// experiment cost the default suite about 4 s each.
const PROBED: &[&str] = &[
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "ckpt",
    "ckpt.memory",
];

/// Imports each module named after it, one by one, and prints what failed of
/// each (`null` where it imported), as one JSON object.
const PROBE: &str = "import importlib, json, sys
out = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
        out[m] = None
    except BaseException as e:
        out[m] = f'{type(e).__name__}: {e}'
print(json.dumps(out))
";

/// What importing each module gave in each interpreter: `None` where it
/// imported, else the error.
type Probed = HashMap<(PathBuf, String), Option<String>>;
static IMPORTS: Mutex<Option<Probed>> = Mutex::new(None);

/// Import `modules` (and, the first time, every module of [`PROBED`]) in
/// one process of `py`, remembering each one's outcome.
fn probe(py: &Path, modules: &[&str], cache: &mut Probed) {
    let mut ask: Vec<&str> = modules.to_vec();
    if !cache.keys().any(|(p, _)| p == py) {
        ask.extend(PROBED.iter().copied().filter(|m| !modules.contains(m)));
    }
    let out = Command::new(py)
        .arg("-c")
        .arg(PROBE)
        .args(&ask)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output();
    let found: HashMap<String, Option<String>> = match &out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_default(),
        _ => HashMap::new(),
    };
    for m in ask {
        let got = match (found.get(m), &out) {
            (Some(v), _) => v.clone(),
            (None, Ok(o)) => Some(
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("the interpreter failed")
                    .to_owned(),
            ),
            (None, Err(e)) => Some(e.to_string()),
        };
        cache.insert((py.to_path_buf(), m.to_owned()), got);
    }
}

/// Why a Python-driven experiment cannot run: no interpreter, or `imports`
/// (a Python `import` statement's list) fail in it; `None` when it can.
pub(crate) fn python_missing(python: Option<&Path>, imports: &str) -> Option<String> {
    let Some(py) = python else {
        return Some("no Python interpreter (set CKPT_PYTHON or run scripts/setup.sh)".into());
    };
    let modules: Vec<&str> = imports
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .collect();
    let mut guard = IMPORTS.lock().unwrap_or_else(|e| e.into_inner());
    let cache = guard.get_or_insert_with(HashMap::new);
    let unknown: Vec<&str> = modules
        .iter()
        .copied()
        .filter(|m| !cache.contains_key(&(py.to_path_buf(), (*m).to_owned())))
        .collect();
    if !unknown.is_empty() {
        probe(py, &unknown, cache);
    }
    let err = modules.iter().find_map(|m| {
        cache
            .get(&(py.to_path_buf(), (*m).to_owned()))
            .cloned()
            .flatten()
    })?;
    let hint = if err.contains("'ckpt'") {
        " (the ckpt Python package is not built: run ./scripts/setup.sh)"
    } else {
        ""
    };
    Some(format!(
        "{} cannot import {imports}: {err}{hint}",
        py.display()
    ))
}

/// A free TCP port on loopback (for torchrun's rendezvous).
pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The JSON object a script printed last on its own line, given what
/// [`run_bounded`] returned; else an error naming `what` with the output's tail.
pub(crate) fn last_json(
    ok: bool,
    stdout: &str,
    stderr: &str,
    what: &str,
) -> Result<serde_json::Value, Error> {
    match (ok, stdout.lines().rev().find(|l| l.starts_with('{'))) {
        (true, Some(line)) => Ok(serde_json::from_str(line)?),
        _ => Err(format!(
            "{what} failed:\n{}",
            tail(&format!("{stdout}\n{stderr}"), 12)
        )
        .into()),
    }
}

/// Run `cmd` to completion within `limit`; returns (success, stdout, stderr).
/// It runs in a process group of its own, so past `limit` torchrun and every
/// rank it started (or a script and its writer processes) are killed together
/// (killing torchrun alone orphans them). `what` names it in the error.
pub(crate) fn run_bounded(
    mut cmd: Command,
    limit: Duration,
    what: &str,
) -> Result<(bool, String, String), Error> {
    use std::os::unix::process::CommandExt;
    let mut child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = out.as_mut() {
            let _ = p.read_to_string(&mut s);
        }
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = err.as_mut() {
            let _ = p.read_to_string(&mut s);
        }
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if start.elapsed() > limit {
            // SAFETY: kill(2) of a process group with a signal number has no memory effects.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (stdout, stderr) = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
    match status {
        Some(s) => Ok((s.success(), stdout, stderr)),
        None => Err(format!("{what} ran past {} s", limit.as_secs()).into()),
    }
}

/// The last `lines` lines of `s`.
pub(crate) fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_module_is_named_and_one_probe_answers_every_later_question() {
        let py = Path::new("python3");
        assert_eq!(python_missing(Some(py), "json, os.path"), None);
        let why = python_missing(Some(py), "json, ckpt_no_such_module").expect("a missing module");
        assert!(
            why.contains("ModuleNotFoundError") && why.contains("ckpt_no_such_module"),
            "{why}"
        );
        // Both answers, and every module of PROBED, are remembered.
        let guard = IMPORTS.lock().unwrap();
        let cache = guard.as_ref().unwrap();
        for m in ["json", "os.path", "ckpt_no_such_module", "torch", "ckpt"] {
            assert!(cache.contains_key(&(py.to_path_buf(), m.to_owned())), "{m}");
        }
        assert_eq!(cache[&(py.to_path_buf(), "json".to_owned())], None);
        assert!(python_missing(None, "json")
            .unwrap()
            .contains("no Python interpreter"));
    }
}
