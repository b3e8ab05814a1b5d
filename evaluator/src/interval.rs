//! How often to checkpoint: the Young/Daly optimal interval and the expected goodput.
//!
//! With checkpoint cost `C` (the time training is stalled per checkpoint), mean
//! time between failures `M`, and restart cost `R` (time from failure to training
//! again, before redoing lost work):
//!
//! - Young (1974): `T = sqrt(2 C M)`.
//! - Daly (2006), first order with the correction term: `T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`
//!   for `C < 2M`, else `T = M`.
//! - Expected goodput (the useful fraction of time) of an interval `T`, first order:
//!   each period of `T + C` does `T` useful work; a failure (rate `1/M`) costs `R`
//!   plus on average half a period redone: `goodput = T / (T + C) * (1 - (R + (T + C) / 2) / M)`,
//!   clamped to `[0, 1]`.

use serde::Serialize;

/// Young's optimal interval (seconds of work between checkpoints).
pub fn young(cost: f64, mtbf: f64) -> f64 {
    (2.0 * cost * mtbf).sqrt()
}

/// Daly's higher-order optimal interval.
pub fn daly(cost: f64, mtbf: f64) -> f64 {
    if cost >= 2.0 * mtbf {
        return mtbf;
    }
    let base = (2.0 * cost * mtbf).sqrt();
    base * (1.0 + (cost / (2.0 * mtbf)).sqrt() / 3.0 + cost / (18.0 * mtbf)) - cost
}

/// Expected useful fraction of time with interval `t`, checkpoint cost `cost`,
/// restart cost `restart`, and mean time between failures `mtbf`.
pub fn goodput(t: f64, cost: f64, restart: f64, mtbf: f64) -> f64 {
    if t <= 0.0 {
        return 0.0;
    }
    let period = t + cost;
    let lost = (restart + period / 2.0) / mtbf;
    (t / period * (1.0 - lost)).clamp(0.0, 1.0)
}

/// The recommendation for one setup.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The setup's name.
    pub setup: String,
    /// Checkpoint cost (training stall per checkpoint), seconds.
    pub cost_s: f64,
    /// Young's interval, seconds.
    pub young_s: f64,
    /// Daly's interval, seconds.
    pub daly_s: f64,
    /// Expected goodput at Daly's interval.
    pub goodput: f64,
}

/// Plan for a setup.
pub fn plan(setup: &str, cost: f64, restart: f64, mtbf: f64) -> Plan {
    let d = daly(cost, mtbf);
    Plan {
        setup: setup.to_owned(),
        cost_s: cost,
        young_s: young(cost, mtbf),
        daly_s: d,
        goodput: goodput(d, cost, restart, mtbf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn young_by_hand() {
        // C = 2 s, M = 1 h: sqrt(2 * 2 * 3600) = 120 s.
        assert!((young(2.0, 3600.0) - 120.0).abs() < 1e-9);
    }

    #[test]
    fn daly_by_hand() {
        // C = 2, M = 3600: 120 * (1 + sqrt(2/7200)/3 + 2/64800) - 2
        //   = 120 * (1 + 0.0055556 + 0.0000309) - 2 = 118.670370...
        let d = daly(2.0, 3600.0);
        assert!((d - 118.670_37).abs() < 1e-3, "{d}");
        assert_eq!(daly(10.0, 4.0), 4.0);
    }

    #[test]
    fn goodput_by_hand() {
        // T = 100, C = 10, R = 20, M = 1000: 100/110 * (1 - (20 + 55)/1000) = 0.8409...
        let g = goodput(100.0, 10.0, 20.0, 1000.0);
        assert!((g - 100.0 / 110.0 * 0.925).abs() < 1e-12, "{g}");
        assert_eq!(goodput(0.0, 1.0, 1.0, 10.0), 0.0);
        assert_eq!(goodput(1e9, 1.0, 1.0, 10.0), 0.0);
        // The optimum beats intervals far from it.
        let (c, r, m) = (5.0, 30.0, 7200.0);
        let best = goodput(daly(c, m), c, r, m);
        assert!(best > goodput(daly(c, m) / 4.0, c, r, m));
        assert!(best > goodput(daly(c, m) * 4.0, c, r, m));
    }
}
