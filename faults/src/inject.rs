//! Failures applied from outside the job: damage to stored objects, a full disk,
//! SIGKILL of a process by pid.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use super::oracle::Scan;
use super::plan::{Action, Rng, Target};
use ckpt_core::CheckpointId;

/// One damaged object.
#[derive(Debug, Clone, Serialize)]
pub struct Corruption {
    /// What was aimed at.
    pub target: Target,
    /// What was done.
    pub action: Action,
    /// The key damaged, relative to the root.
    pub key: String,
    /// Byte and bit flipped, or the new length.
    pub detail: String,
    /// Committed checkpoints that need the object.
    #[serde(skip)]
    pub affects: Vec<CheckpointId>,
}

/// Every object under a root (keys relative to it), sorted.
pub fn objects(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for dir in [
        ckpt_core::layout::CHUNKS,
        ckpt_core::layout::DATA,
        ckpt_core::layout::MANIFESTS,
    ] {
        walk(&root.join(dir), dir, &mut out);
    }
    out.sort();
    out
}

fn walk(dir: &Path, key: &str, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let k = format!("{key}/{name}");
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&e.path(), &k, out),
            Ok(t) if t.is_file() => out.push(k),
            _ => {}
        }
    }
}

/// Damage one object chosen by `target`; `None` when there is nothing to damage.
pub fn corrupt(
    root: &Path,
    scan: &Scan,
    rng: &mut Rng,
    target: Target,
    action: Action,
) -> std::io::Result<Option<Corruption>> {
    let newest = scan.newest();
    let shared: Vec<String> = match scan.committed.as_slice() {
        [first, rest @ ..] if !rest.is_empty() => first
            .objects
            .iter()
            .filter(|o| rest.iter().all(|c| c.objects.contains(*o)))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    let candidates: Vec<String> = match (target, newest) {
        (Target::NewestManifest, Some(n)) => vec![n.manifest_key.clone()],
        (Target::NewestChunk, Some(n)) => {
            let only: Vec<String> = n
                .objects
                .iter()
                .filter(|o| **o != n.manifest_key && !shared.contains(o))
                .cloned()
                .collect();
            if only.is_empty() {
                n.objects.iter().cloned().collect()
            } else {
                only
            }
        }
        (Target::SharedChunk, Some(n)) if !shared.is_empty() => shared
            .iter()
            .filter(|o| **o != n.manifest_key)
            .cloned()
            .collect(),
        _ => objects(root),
    };
    let candidates: Vec<String> = candidates
        .into_iter()
        .filter(|k| root.join(k).is_file())
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    let key = rng.pick(&candidates).clone();
    let path = root.join(&key);
    let detail = match action {
        Action::FlipBit => {
            let mut b = std::fs::read(&path)?;
            if b.is_empty() {
                return Ok(None);
            }
            let at = rng.range(0, b.len() as u64 - 1) as usize;
            let bit = rng.range(0, 7) as u8;
            b[at] ^= 1 << bit;
            write_in_place(&path, &b)?;
            format!("byte {at} bit {bit} of {}", b.len())
        }
        Action::Truncate => {
            let len = std::fs::metadata(&path)?.len();
            if len == 0 {
                return Ok(None);
            }
            let to = rng.range(0, len - 1);
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)?
                .set_len(to)?;
            format!("{len} -> {to} bytes")
        }
        Action::Delete => {
            std::fs::remove_file(&path)?;
            "deleted".to_owned()
        }
    };
    let affects = scan
        .committed
        .iter()
        .filter(|c| c.objects.contains(&key))
        .map(|c| c.id.clone())
        .collect();
    Ok(Some(Corruption {
        target,
        action,
        key,
        detail,
        affects,
    }))
}

fn write_in_place(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// A small tmpfs mounted for one run; unmounted on drop.
#[derive(Debug)]
pub struct Tmpfs {
    /// The mount point.
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mount a tmpfs of `mib` MiB at `dir` (needs mount privileges).
    pub fn mount(dir: &Path, mib: u64) -> Result<Tmpfs, crate::error::Error> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs refused: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        Ok(Tmpfs {
            dir: dir.to_owned(),
        })
    }

    /// Free bytes on the file system.
    pub fn free(&self) -> u64 {
        free_bytes(&self.dir).unwrap_or(0)
    }

    /// Fill the file system with a ballast file until `leave` bytes are free.
    pub fn fill(&self, leave: u64) -> std::io::Result<PathBuf> {
        use std::io::Write;
        let path = self.dir.join("ballast");
        let mut f = std::fs::File::create(&path)?;
        let block = vec![0xA5u8; 64 << 10];
        loop {
            let free = self.free();
            if free <= leave {
                break;
            }
            let n = ((free - leave) as usize).min(block.len());
            if f.write_all(&block[..n]).is_err() {
                break;
            }
            f.flush()?;
        }
        Ok(path)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).output();
    }
}

/// Free bytes available to unprivileged writers on the file system of `path`.
pub fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// SIGKILL a process by pid.
pub fn sigkill(pid: u32) -> bool {
    // SAFETY: kill(2) with a pid and a signal number has no memory effects.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) == 0 }
}

/// Pids of the processes whose environment holds `key=value` and, if given,
/// `OMPI_COMM_WORLD_RANK=rank`.
pub fn pids_with_env(key: &str, value: &str, rank: Option<usize>) -> Vec<u32> {
    let want = format!("{key}={value}");
    let want_rank = rank.map(|r| format!("OMPI_COMM_WORLD_RANK={r}"));
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        let has = |s: &str| vars.contains(&s.as_bytes());
        if has(&want) && want_rank.as_deref().is_none_or(has) {
            out.push(pid);
        }
    }
    out
}
