//! Plots as plain SVG: shapes and `<text>`, which the viewer sets in its own
//! fonts (no raster, no font of ours). Two kinds: horizontal bars with min-max
//! whiskers, and lines.

use std::path::Path;

/// Colours of series and bars.
const PALETTE: [[u8; 3]; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];

/// One horizontal bar: label, median, and the spread (min, max).
#[derive(Debug, Clone)]
pub struct Bar {
    /// Row label.
    pub label: String,
    /// Bar length.
    pub value: f64,
    /// Whisker from.
    pub lo: f64,
    /// Whisker to.
    pub hi: f64,
    /// Palette index (bars of one group share a colour).
    pub group: usize,
}

/// A bar of a summary's median and spread.
pub fn bar(label: &str, s: &crate::stats::Summary, group: usize) -> Bar {
    Bar {
        label: label.into(),
        value: s.median,
        lo: s.min,
        hi: s.max,
        group,
    }
}

/// A chart.
#[derive(Debug, Clone)]
pub enum Chart {
    /// Horizontal bars.
    Bars {
        /// Title.
        title: String,
        /// Unit of the values (printed after them and on the axis).
        unit: String,
        /// The bars, top to bottom.
        bars: Vec<Bar>,
        /// A vertical reference line (label, value), e.g. a machine floor.
        reference: Option<(String, f64)>,
    },
    /// Lines.
    Lines {
        /// Title.
        title: String,
        /// x axis label.
        x_label: String,
        /// y axis label.
        y_label: String,
        /// Logarithmic x axis.
        log_x: bool,
        /// (name, points).
        series: Vec<(String, Vec<(f64, f64)>)>,
    },
}

/// Drawing primitives (the SVG writer implements them).
trait Painter {
    fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: [u8; 3]);
    fn line(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, c: [u8; 3], dashed: bool);
    /// `anchor`: 0 start, 1 middle, 2 end; `big` for titles.
    fn text(&mut self, x: f64, y: f64, s: &str, anchor: u8, big: bool);
}

const W: f64 = 820.0;

/// Format a number compactly.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// A "nice" upper bound for an axis.
pub fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * p)
}

impl Chart {
    /// Height in pixels.
    pub fn height(&self) -> f64 {
        match self {
            Chart::Bars { bars, .. } => 90.0 + 26.0 * bars.len() as f64,
            Chart::Lines { .. } => 420.0,
        }
    }

    fn draw(&self, p: &mut dyn Painter) {
        let h = self.height();
        p.rect(0.0, 0.0, W, h, [255, 255, 255]);
        match self {
            Chart::Bars {
                title,
                unit,
                bars,
                reference,
            } => {
                p.text(W / 2.0, 24.0, title, 1, true);
                let (x0, x1) = (230.0, W - 110.0);
                let max = bars
                    .iter()
                    .map(|b| b.hi.max(b.value))
                    .chain(reference.iter().map(|r| r.1))
                    .fold(0.0, f64::max);
                let max = nice_max(max);
                let sx = |v: f64| x0 + (x1 - x0) * (v / max).clamp(0.0, 1.0);
                let top = 44.0;
                let bottom = top + 26.0 * bars.len() as f64;
                for k in 0..=4 {
                    let v = max * k as f64 / 4.0;
                    p.line(sx(v), top, sx(v), bottom, [225, 225, 225], false);
                    p.text(sx(v), bottom + 16.0, &fmt_num(v), 1, false);
                }
                p.text((x0 + x1) / 2.0, bottom + 34.0, unit, 1, false);
                for (i, b) in bars.iter().enumerate() {
                    let y = top + 26.0 * i as f64;
                    p.text(x0 - 8.0, y + 17.0, &b.label, 2, false);
                    p.rect(
                        x0,
                        y + 5.0,
                        sx(b.value) - x0,
                        16.0,
                        PALETTE[b.group % PALETTE.len()],
                    );
                    if b.hi > b.lo {
                        p.line(sx(b.lo), y + 13.0, sx(b.hi), y + 13.0, [0, 0, 0], false);
                        p.line(sx(b.lo), y + 8.0, sx(b.lo), y + 18.0, [0, 0, 0], false);
                        p.line(sx(b.hi), y + 8.0, sx(b.hi), y + 18.0, [0, 0, 0], false);
                    }
                    p.text(
                        sx(b.hi.max(b.value)) + 6.0,
                        y + 17.0,
                        &fmt_num(b.value),
                        0,
                        false,
                    );
                }
                p.line(x0, top, x0, bottom, [0, 0, 0], false);
                if let Some((label, v)) = reference {
                    p.line(sx(*v), top - 4.0, sx(*v), bottom, [200, 0, 0], true);
                    p.text(sx(*v), top - 8.0, label, 1, false);
                }
            }
            Chart::Lines {
                title,
                x_label,
                y_label,
                log_x,
                series,
            } => {
                p.text(W / 2.0, 24.0, title, 1, true);
                let (x0, x1, y0, y1) = (70.0, W - 200.0, h - 60.0, 50.0);
                let pts = series.iter().flat_map(|s| s.1.iter());
                let (mut xmin, mut xmax, mut ymax) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
                for &(x, y) in pts {
                    xmin = xmin.min(x);
                    xmax = xmax.max(x);
                    ymax = ymax.max(y);
                }
                if !xmin.is_finite() || xmax <= xmin {
                    xmin = if *log_x { 1.0 } else { 0.0 };
                    xmax = xmin + 10.0;
                }
                let ymax = nice_max(ymax);
                let tx = |x: f64| if *log_x { x.max(1e-12).ln() } else { x };
                let (a, b) = (tx(xmin), tx(xmax));
                let sx = |x: f64| x0 + (x1 - x0) * (tx(x) - a) / (b - a);
                let sy = |y: f64| y0 - (y0 - y1) * (y / ymax).clamp(0.0, 1.0);
                for k in 0..=4 {
                    let v = ymax * k as f64 / 4.0;
                    p.line(x0, sy(v), x1, sy(v), [225, 225, 225], false);
                    p.text(x0 - 6.0, sy(v) + 4.0, &fmt_num(v), 2, false);
                }
                let ticks: Vec<f64> = if *log_x {
                    let mut t = Vec::new();
                    let mut d = 10f64.powf(xmin.log10().floor());
                    let decades = (xmax / xmin).log10();
                    let mult: &[f64] = if decades <= 2.5 {
                        &[1.0, 2.0, 5.0]
                    } else {
                        &[1.0]
                    };
                    while d <= xmax * 1.0001 {
                        for &m in mult {
                            if d * m >= xmin * 0.9999 && d * m <= xmax * 1.0001 {
                                t.push(d * m);
                            }
                        }
                        d *= 10.0;
                    }
                    t
                } else {
                    (0..=4)
                        .map(|k| xmin + (xmax - xmin) * k as f64 / 4.0)
                        .collect()
                };
                for t in ticks {
                    p.line(sx(t), y0, sx(t), y0 + 4.0, [0, 0, 0], false);
                    p.text(sx(t), y0 + 18.0, &fmt_num(t), 1, false);
                }
                p.line(x0, y0, x1, y0, [0, 0, 0], false);
                p.line(x0, y0, x0, y1, [0, 0, 0], false);
                p.text((x0 + x1) / 2.0, y0 + 40.0, x_label, 1, false);
                p.text(x0, y1 - 10.0, y_label, 0, false);
                for (i, (name, pts)) in series.iter().enumerate() {
                    let c = PALETTE[i % PALETTE.len()];
                    for w in pts.windows(2) {
                        p.line(sx(w[0].0), sy(w[0].1), sx(w[1].0), sy(w[1].1), c, false);
                    }
                    let ly = y1 + 18.0 * i as f64;
                    p.rect(x1 + 14.0, ly - 6.0, 14.0, 4.0, c);
                    p.text(x1 + 34.0, ly, name, 0, false);
                }
            }
        }
    }

    /// The chart as an SVG document.
    pub fn to_svg(&self) -> String {
        let mut s = Svg(String::new());
        self.draw(&mut s);
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" viewBox=\"0 0 {W} {h}\" font-family=\"sans-serif\">\n{}</svg>\n",
            s.0,
            h = self.height()
        )
    }

    /// Write `<dir>/<name>.svg`.
    pub fn save(&self, dir: &Path, name: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(format!("{name}.svg")), self.to_svg())
    }
}

fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

struct Svg(String);

impl Painter for Svg {
    fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: [u8; 3]) {
        self.0 += &format!(
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"/>\n",
            w.max(0.0),
            hex(c)
        );
    }
    fn line(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, c: [u8; 3], dashed: bool) {
        let dash = if dashed {
            " stroke-dasharray=\"5,4\""
        } else {
            ""
        };
        self.0 += &format!("<line x1=\"{x0:.1}\" y1=\"{y0:.1}\" x2=\"{x1:.1}\" y2=\"{y1:.1}\" stroke=\"{}\" stroke-width=\"1.5\"{dash}/>\n", hex(c));
    }
    fn text(&mut self, x: f64, y: f64, s: &str, anchor: u8, big: bool) {
        let a = ["start", "middle", "end"][anchor.min(2) as usize];
        let size = if big { 16 } else { 12 };
        self.0 += &format!(
            "<text x=\"{x:.1}\" y=\"{y:.1}\" font-size=\"{size}\" text-anchor=\"{a}\">{}</text>\n",
            escape(s)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bars() -> Chart {
        Chart::Bars {
            title: "save <time>".into(),
            unit: "s".into(),
            bars: vec![
                Bar {
                    label: "a".into(),
                    value: 1.0,
                    lo: 0.8,
                    hi: 1.3,
                    group: 0,
                },
                Bar {
                    label: "b".into(),
                    value: 2.0,
                    lo: 2.0,
                    hi: 2.0,
                    group: 1,
                },
            ],
            reference: Some(("floor".into(), 0.5)),
        }
    }

    #[test]
    fn svg_is_well_formed_and_escaped() {
        let s = bars().to_svg();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("save &lt;time&gt;"));
        assert_eq!(s.matches("<rect").count(), 3, "background + two bars");
        assert!(s.contains("stroke-dasharray"), "reference line");
    }

    #[test]
    fn axis_helpers_by_hand() {
        assert_eq!(nice_max(0.37), 0.4);
        assert_eq!(nice_max(3.0), 3.0);
        assert_eq!(nice_max(255.0), 300.0);
        assert_eq!(nice_max(8.5), 10.0);
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(fmt_num(123.4), "123");
        assert_eq!(fmt_num(0.01234), "0.012");
    }
}
