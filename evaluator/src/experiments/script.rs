//! Running the Python benchmark scripts (written out by
//! [`crate::python::write_bench_script`]): whether they can run here, and a
//! run under a time limit in a process group of its own.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::Error;

/// Why a Python-driven experiment cannot run: no interpreter, or `imports`
/// (a Python `import` statement's list) fail in it; `None` when it can.
pub(crate) fn python_missing(python: Option<&Path>, imports: &str) -> Option<String> {
    let Some(py) = python else {
        return Some("no Python interpreter (set CKPT_PYTHON or run scripts/setup.sh)".into());
    };
    let out = Command::new(py)
        .args(["-c", &format!("import {imports}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    let err = match out {
        Ok(o) if o.status.success() => return None,
        Ok(o) => String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_owned(),
        Err(e) => e.to_string(),
    };
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
