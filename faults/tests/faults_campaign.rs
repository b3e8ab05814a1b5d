//! A small fault campaign over the real tch training job (`fault_victim`): SIGKILLs
//! at random instants, aborts and SIGKILLs inside each phase of a save, bit flips,
//! truncations and deletions of stored objects, storage faults, a full disk, a
//! frozen incarnation resumed beside its restart (a zombie); and,
//! where the MPI jobs are built, a rank killed under mpirun. Nothing may be lost:
//! no torn or damaged checkpoint loaded, every corruption that mattered detected,
//! every restart where the on-disk oracle says, final weights bitwise identical to
//! the failure-free run.

use std::path::{Path, PathBuf};

use ckpt_faults::plan::Kind;
use ckpt_faults::{self as faults, mpi, report, CampaignConfig};

const VICTIM: &str = env!("CARGO_BIN_EXE_fault_victim");

fn config(count: u64, seed: u64, work: &Path, kinds: &[Kind]) -> CampaignConfig {
    let mut cfg = CampaignConfig::new(count, seed, PathBuf::from(VICTIM), work.to_owned());
    cfg.kinds = kinds.to_vec();
    cfg.steps = 24;
    cfg.every = 3;
    cfg.keep = 3;
    cfg.per_run = 6;
    cfg.progress = true;
    cfg
}

#[test]
fn small_campaign_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let kinds: Vec<Kind> = Kind::ALL.into_iter().filter(|k| !k.is_mpi()).collect();
    let r = faults::campaign(&config(40, 7, &dir.path().join("work"), &kinds)).unwrap();
    let text = report::to_text(&r);
    eprintln!("{text}");
    let s = &r.summary;
    assert!(s.failures_total >= 40, "{text}");
    for k in &kinds {
        assert!(
            s.failures.get(k.name()).copied().unwrap_or(0) >= 1,
            "no {} failure was injected\n{text}",
            k.name()
        );
    }
    assert!(s.restarts >= 20, "{text}");
    assert!(s.torn_saves >= 1, "no death landed inside a save\n{text}");
    assert_eq!(s.torn_or_damaged_loaded, 0, "{text}");
    assert_eq!(s.wrong_resume, 0, "{text}");
    assert!(s.corruptions["applied"] >= 3, "{text}");
    assert!(s.corruptions["detected"] >= 1, "{text}");
    assert_eq!(s.corruptions["undetected"], 0, "{text}");
    assert!(
        s.skipped_by_kind.values().sum::<u64>() >= 1,
        "no damaged checkpoint was skipped\n{text}"
    );
    assert!(
        s.store_faults.values().sum::<u64>() >= 1,
        "the store injected nothing\n{text}"
    );
    assert!(!s.failed_saves.is_empty(), "no save ever failed\n{text}");
    // Zombies: the old incarnation fenced, none of its checkpoints
    // loaded, nothing the new one keeps damaged.
    assert!(s.zombies["episodes"] >= 1, "{text}");
    // (An old incarnation that saved unfenced is a problem of its run.)
    assert!(s.zombies["old incarnation fenced"] >= 1, "{text}");
    assert_eq!(s.zombies["zombie checkpoints loaded"], 0, "{text}");
    assert_eq!(s.zombies["kept checkpoints damaged"], 0, "{text}");
    assert_eq!(s.finals_compared, s.runs, "{text}");
    assert_eq!(s.finals_identical, s.runs, "{text}");
    assert!(r.passed(), "{text}");
    torch_baseline_is_reported(&r, &text);
}

/// The restart figures beside the torch baseline: present, positive, in the text.
fn torch_baseline_is_reported(r: &report::CampaignReport, text: &str) {
    let c = r
        .summary
        .torch_baseline
        .as_ref()
        .unwrap_or_else(|| panic!("no torch baseline: {:?}\n{text}", r.summary.not_run));
    let b = &c.torch;
    // One restore after each tch run, at least three.
    assert!(b.restores >= 3.max(r.summary.runs), "{text}");
    assert_eq!(b.load_ms.n, b.restores, "{text}");
    assert_eq!(b.recovery_ms.n, b.restores, "{text}");
    assert!(
        b.load_ms.median > 0.0 && b.recovery_ms.median > 0.0,
        "{text}"
    );
    assert!(b.tensors > 0 && b.bytes > 0 && b.save_ms > 0.0, "{text}");
    assert!(
        c.ckpt_recovery_ms.n >= 1,
        "no comparable ckpt restart\n{text}"
    );
    assert!(c.ckpt_load_ms.median > 0.0, "{text}");
    for ratio in [c.recovery_ratio, c.load_ratio] {
        assert!(ratio.is_some_and(|x| x.is_finite() && x > 0.0), "{text}");
    }
    assert!(
        text.contains("restart beside torch save_multi/load_multi"),
        "{text}"
    );
    assert!(text.contains("ckpt/torch"), "{text}");
    let json = serde_json::to_value(r).unwrap();
    let j = &json["summary"]["torch_baseline"];
    assert!(j["recovery_ratio"].as_f64().is_some_and(|x| x > 0.0), "{j}");
    assert!(
        j["torch"]["load_ms"]["median"]
            .as_f64()
            .is_some_and(|x| x > 0.0),
        "{j}"
    );
}

#[test]
fn mpi_ranks_killed_mid_save_lose_nothing() {
    let bins = mpi::MpiBins {
        ckpt: target_bin("mpi_ckpt"),
        train: target_bin("mpi_train"),
    };
    for (bin, name) in [(&bins.ckpt, "mpi_ckpt"), (&bins.train, "mpi_train")] {
        if let Some(why) = mpi::unavailable(bin, name) {
            eprintln!("skipped: {why}");
            return;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(
        4,
        11,
        &dir.path().join("work"),
        &[Kind::MpiRank, Kind::MpiTrain],
    );
    cfg.mpi = bins;
    let r = faults::campaign(&cfg).unwrap();
    let text = report::to_text(&r);
    eprintln!("{text}");
    let s = &r.summary;
    assert!(
        s.failures.get("mpi-rank").copied().unwrap_or(0) >= 1,
        "{text}"
    );
    assert!(
        s.failures.get("mpi-train").copied().unwrap_or(0) >= 1,
        "{text}"
    );
    assert_eq!(s.finals_identical, s.finals_compared, "{text}");
    assert!(r.passed(), "{text}");
    assert!(
        s.torch_baseline.is_none(),
        "no tch run, no baseline\n{text}"
    );
}

/// A binary of another package in the same target directory (built by
/// `cargo test --workspace --all-features`).
fn target_bin(name: &str) -> Option<PathBuf> {
    let p = Path::new(VICTIM).parent()?.join(name);
    p.is_file().then_some(p)
}
