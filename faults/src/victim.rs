//! One start of the victim training job (`fault_victim`), supervised: its stdout
//! read line by line, SIGKILLed when the plan says, its report lines collected.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ckpt_core::store::FaultCounts;

use super::event::{self, Event};

/// The training job every start of a run shares.
#[derive(Debug, Clone)]
pub struct Job {
    /// The victim's program: the `fault_victim` binary, or an interpreter.
    pub bin: PathBuf,
    /// Arguments before the victim's own (an interpreter's script).
    pub bin_args: Vec<String>,
    /// Steps to train.
    pub steps: u64,
    /// Checkpoint every this many steps.
    pub every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// The training seed.
    pub seed: u64,
    /// `cpu` or `cuda`.
    pub device: String,
}

/// When the supervisor SIGKILLs the process.
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    /// Never: let it finish (or die by itself).
    Never,
    /// After the line `step N ...` with N >= `step`, plus `delay_us`.
    AtStep {
        /// The step.
        step: u64,
        /// Extra delay, microseconds.
        delay_us: u64,
    },
    /// When no line came for `ms` after training started (a save parked at a failpoint).
    OnSilence {
        /// Silence, milliseconds.
        ms: u64,
    },
    /// Like `AtStep`, but SIGSTOP instead of SIGKILL: the job is frozen (a
    /// hung incarnation), and [`Running::supervise`] returns.
    Freeze {
        /// The step.
        step: u64,
        /// Extra delay, microseconds.
        delay_us: u64,
    },
    /// SIGSTOP once training started and no line came for `ms` (a save
    /// parked at a failpoint), and return, as `Freeze` does.
    FreezeOnSilence {
        /// Silence, milliseconds.
        ms: u64,
    },
    /// `extra` steps after a save failed, or at step `fallback`.
    AfterSaveFailure {
        /// Steps after the failure.
        extra: u64,
        /// Kill here if no save failed.
        fallback: u64,
    },
}

/// How a start ended, and what it said.
#[derive(Debug, Clone, Default)]
pub struct StartOut {
    /// Stdout lines.
    pub lines: Vec<String>,
    /// Milliseconds from spawn to the first `step` line.
    pub first_step_ms: Option<f64>,
    /// Highest step reached.
    pub reached: u64,
    /// The supervisor sent SIGKILL.
    pub killed: bool,
    /// The signal that ended it, if any.
    pub signal: Option<i32>,
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Printed `done`.
    pub done: bool,
    /// A save started and neither committed nor failed: the save the death tore.
    pub in_flight: Option<u64>,
    /// Steps of saves that failed.
    pub failed_saves: Vec<(u64, String)>,
    /// The events this start appended to the report.
    pub report: Vec<Event>,
    /// Ran past the watchdog.
    pub hung: bool,
}

impl StartOut {
    /// The `start` event.
    pub fn start_event(&self) -> Option<&Event> {
        self.report
            .iter()
            .find(|e| matches!(e, Event::Start { .. }))
    }

    /// The `error` event.
    pub fn error_event(&self) -> Option<&event::Failure> {
        self.report.iter().find_map(|e| match e {
            Event::Error(f) => Some(f),
            _ => None,
        })
    }

    /// The last fault counts reported.
    pub fn faults(&self) -> Option<&FaultCounts> {
        self.report.iter().rev().find_map(Event::faults)
    }

    /// How it ended, in words.
    pub fn ended(&self) -> String {
        match (self.done, self.killed, self.signal, self.code) {
            (true, _, _, _) => "done".into(),
            (_, true, _, _) => "sigkill".into(),
            (_, _, Some(6), _) => "abort".into(),
            (_, _, Some(s), _) => format!("signal {s}"),
            (_, _, _, Some(c)) => format!("exit {c}"),
            _ => "unknown".into(),
        }
    }
}

/// N of the line `step N loss L`.
fn step_of(line: &str) -> Option<u64> {
    line.strip_prefix("step ")?.split(' ').next()?.parse().ok()
}

/// Start the job once on `root` and supervise it. An error: it could not be
/// started, or its report has a line that is not an [`Event`].
pub fn start(
    job: &Job,
    root: &Path,
    out: &Path,
    report: &Path,
    env: &[(String, String)],
    args: &[String],
    stop: Stop,
) -> std::io::Result<StartOut> {
    let mut r = Running::spawn(job, root, out, report, env, args)?;
    r.supervise(stop);
    r.finish()
}

/// Send `sig` to a child of this process that is not reaped yet; true when
/// it was delivered.
pub fn send_signal(pid: u32, sig: i32) -> bool {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; the
    // pid is a child not yet waited for, so it cannot have been reused.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// A start of the job in progress.
pub struct Running {
    child: Child,
    rx: mpsc::Receiver<(Instant, String)>,
    reader: Option<std::thread::JoinHandle<()>>,
    spawned: Instant,
    /// Since when the watchdog counts (reset when a frozen job is resumed).
    watched: Instant,
    offset: u64,
    report: PathBuf,
    o: StartOut,
    last: Instant,
    trained: bool,
    open_save: Option<u64>,
}

impl Running {
    /// Spawn the job on `root`.
    pub fn spawn(
        job: &Job,
        root: &Path,
        out: &Path,
        report: &Path,
        env: &[(String, String)],
        args: &[String],
    ) -> std::io::Result<Running> {
        let offset = std::fs::metadata(report).map(|m| m.len()).unwrap_or(0);
        let mut cmd = Command::new(&job.bin);
        cmd.args(&job.bin_args)
            .arg("--root")
            .arg(root)
            .arg("--out")
            .arg(out)
            .arg("--report")
            .arg(report)
            .args(["--steps", &job.steps.to_string()])
            .args(["--every", &job.every.to_string()])
            .args(["--keep", &job.keep.to_string()])
            .args(["--seed", &job.seed.to_string()])
            .args(["--device", &job.device])
            .args(args)
            .env_remove("CKPT_FAILPOINTS")
            .env("RUST_LOG", "off")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let spawned = Instant::now();
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel::<(Instant, String)>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Ok(Running {
            child,
            rx,
            reader: Some(reader),
            spawned,
            watched: spawned,
            offset,
            report: report.to_owned(),
            o: StartOut::default(),
            last: Instant::now(),
            trained: false,
            open_save: None,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Highest step reached so far.
    pub fn reached(&self) -> u64 {
        self.o.reached
    }

    /// Send a signal (`SIGSTOP`, `SIGCONT`) to the job.
    pub fn signal(&mut self, sig: i32) -> bool {
        if sig == libc::SIGCONT {
            self.watched = Instant::now();
            self.last = Instant::now();
        }
        send_signal(self.child.id(), sig)
    }

    /// Supervise until the job's output ends, or (with [`Stop::Freeze`]) until
    /// it is frozen: then it returns with the process stopped, to be resumed
    /// with `signal(SIGCONT)` and supervised again.
    pub fn supervise(&mut self, stop: Stop) {
        let o = &mut self.o;
        let mut kill_at_step: Option<u64> = match stop {
            Stop::AtStep { step, .. } | Stop::Freeze { step, .. } => Some(step),
            Stop::AfterSaveFailure { fallback, .. } => Some(fallback),
            _ => None,
        };
        let watchdog = Duration::from_secs(120);
        loop {
            match self.rx.recv_timeout(Duration::from_millis(10)) {
                Ok((at, line)) => {
                    self.last = at;
                    if let Some(s) = step_of(&line) {
                        if o.first_step_ms.is_none() {
                            o.first_step_ms =
                                Some(at.duration_since(self.spawned).as_secs_f64() * 1e3);
                        }
                        self.trained = true;
                        o.reached = o.reached.max(s);
                    } else if let Some(s) = line
                        .strip_prefix("checkpoint ")
                        .and_then(|r| r.strip_suffix(" started"))
                        .and_then(|s| s.parse().ok())
                    {
                        self.open_save = Some(s);
                    } else if let Some(rest) = line.strip_prefix("checkpoint ") {
                        if let Some((s, why)) = rest.split_once(" failed: ") {
                            let s: u64 = s.parse().unwrap_or(0);
                            o.failed_saves.push((s, why.to_owned()));
                            if self.open_save == Some(s) {
                                self.open_save = None;
                            }
                            if let Stop::AfterSaveFailure { extra, .. } = stop {
                                let t = o.reached + extra;
                                kill_at_step = Some(kill_at_step.map_or(t, |k| k.min(t)));
                            }
                        } else if let Some(s) = rest.strip_suffix(" committed") {
                            if self.open_save == s.parse().ok() {
                                self.open_save = None;
                            }
                        }
                    } else if line.starts_with("done ") {
                        o.done = true;
                    }
                    let hit = kill_at_step.is_some_and(|k| step_of(&line).is_some_and(|s| s >= k));
                    o.lines.push(line);
                    if hit && !o.killed {
                        match stop {
                            Stop::AtStep { delay_us, .. } => {
                                std::thread::sleep(Duration::from_micros(delay_us));
                            }
                            Stop::Freeze { delay_us, .. } => {
                                std::thread::sleep(Duration::from_micros(delay_us));
                                if send_signal(self.child.id(), libc::SIGSTOP) {
                                    return;
                                }
                            }
                            _ => {}
                        }
                        o.killed = self.child.kill().is_ok();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Stop::FreezeOnSilence { ms } = stop {
                        if self.trained
                            && self.last.elapsed() >= Duration::from_millis(ms)
                            && send_signal(self.child.id(), libc::SIGSTOP)
                        {
                            return;
                        }
                    }
                    if let Stop::OnSilence { ms } = stop {
                        if self.trained
                            && !o.killed
                            && self.last.elapsed() >= Duration::from_millis(ms)
                        {
                            o.killed = self.child.kill().is_ok();
                        }
                    }
                    if self.watched.elapsed() > watchdog && !o.killed {
                        o.hung = true;
                        o.killed = self.child.kill().is_ok();
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
    }

    /// Wait for the process to end; how it ended and what it reported.
    pub fn finish(mut self) -> std::io::Result<StartOut> {
        let status = self.child.wait()?;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let mut o = self.o;
        o.signal = status.signal();
        o.code = status.code();
        if o.done && o.killed {
            // The signal came after the job finished: it did not interrupt anything.
            o.killed = false;
        }
        o.in_flight = if o.done { None } else { self.open_save };
        o.report = event::read_from(&self.report, self.offset).map_err(std::io::Error::other)?;
        Ok(o)
    }
}
