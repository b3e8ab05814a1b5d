//! The fsdp-scale experiment's tables and chart.

use super::results::FsdpScaleResults;
use crate::plot::Chart;
use crate::stats::Summary;
use crate::table::{opt_ratio, Table};

/// Seconds: the median, and `[min-max]` when there were several repetitions.
fn s(x: &Summary) -> String {
    if x.n > 1 {
        format!("{:.3} [{:.3}-{:.3}]", x.median, x.min, x.max)
    } else {
        format!("{:.3}", x.median)
    }
}

/// The figures per rank count, and the slopes against ranks.
pub fn tables(r: &FsdpScaleResults) -> Vec<Table> {
    let tensors = r.runs.first().map_or(0, |x| x.tensors_per_rank);
    let mut t = Table::new(
        "fsdp_scale",
        format!(
            "FSDP2 with many small tensors: {} fully_shard'ed blocks of Linear({w}, {w}) plus AdamW, {tensors} tensors per rank (torchrun, gloo, CPU, torch {}); ckpt's Checkpointer (torch.distributed coordinator) beside dcp.save/dcp.load (with get_state_dict/set_state_dict) in the same run; slowest rank's seconds after a barrier, median of {} repetition(s); save = a root's first save + wait, later save = the next one after a training step, load = load_latest in place (checked bitwise); manifest = one checkpoint's, dcp metadata = its .metadata",
            r.blocks,
            r.torch,
            r.repeats,
            w = r.width,
        ),
        &[
            "ranks",
            "ckpt save s",
            "dcp save s",
            "ckpt later save s",
            "ckpt load s",
            "dcp load s",
            "ckpt manifest bytes",
            "dcp metadata bytes",
            "save ckpt/dcp",
            "later save ckpt/dcp",
            "load ckpt/dcp",
            "metadata ckpt/dcp",
            "ckpt open s",
        ],
    );
    for x in &r.runs {
        t.rows.push(vec![
            x.ranks.to_string(),
            s(&x.ckpt_save_s),
            s(&x.dcp_save_s),
            s(&x.ckpt_later_save_s),
            s(&x.ckpt_load_s),
            s(&x.dcp_load_s),
            x.manifest_bytes.to_string(),
            x.dcp_metadata_bytes.to_string(),
            opt_ratio(x.ckpt_save_s.median / x.dcp_save_s.median),
            opt_ratio(x.ckpt_later_save_s.median / x.dcp_save_s.median),
            opt_ratio(x.ckpt_load_s.median / x.dcp_load_s.median),
            opt_ratio(x.manifest_bytes as f64 / x.dcp_metadata_bytes as f64),
            s(&x.ckpt_open_s),
        ]);
    }
    let mut sl = Table::new(
        "fsdp_scale_slopes",
        "FSDP2 with many small tensors: growth with ranks, the least-squares slope of ln(value) against ln(ranks) (1 = linear in ranks)".into(),
        &["quantity", "ckpt slope", "dcp slope", "ckpt - dcp"],
    );
    for x in &r.slopes {
        sl.rows.push(vec![
            x.what.clone(),
            format!("{:.2}", x.ckpt),
            format!("{:.2}", x.dcp),
            format!("{:+.2}", x.ckpt - x.dcp),
        ]);
    }
    vec![t, sl]
}

/// Times against ranks (log ranks).
pub fn charts(r: &FsdpScaleResults) -> Vec<(String, Chart)> {
    type Pick = fn(&super::FsdpScaleRun) -> f64;
    let series: [(&str, Pick); 5] = [
        ("ckpt save", |x| x.ckpt_save_s.median),
        ("ckpt later save", |x| x.ckpt_later_save_s.median),
        ("ckpt load", |x| x.ckpt_load_s.median),
        ("dcp.save", |x| x.dcp_save_s.median),
        ("dcp.load", |x| x.dcp_load_s.median),
    ];
    vec![(
        "fsdp_scale_times".into(),
        Chart::Lines {
            title: format!("FSDP2, {} blocks: save and load against ranks", r.blocks),
            x_label: "ranks (log scale)".into(),
            y_label: "seconds, slowest rank".into(),
            log_x: true,
            series: series
                .iter()
                .map(|&(name, f)| {
                    (
                        name.to_owned(),
                        r.runs.iter().map(|x| (x.ranks as f64, f(x))).collect(),
                    )
                })
                .collect(),
        },
    )]
}
