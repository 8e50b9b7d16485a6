//! A small SVG line chart: TTFT p90 (left axis, log scale) and hit ratio
//! (right axis) against a swept parameter (its values evenly spaced). Self-contained (no plotting
//! library), so `kvroute-simulate` can draw without Python.

use super::sweep::{Param, Point};
use std::fmt::Write as _;

const W: f64 = 720.0;
const H: f64 = 420.0;
const L: f64 = 80.0;
const R: f64 = 80.0;
const T: f64 = 50.0;
const B: f64 = 60.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart of a sweep; `title` goes on top.
pub fn sweep_svg(title: &str, param: Param, points: &[Point]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    s.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="14">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // Categorical x axis: the swept values, evenly spaced in sweep order
    // (τ grids are roughly geometric; a linear axis would crush them).
    let n = points.len().max(2) as f64;
    let ttfts: Vec<f64> = points
        .iter()
        .filter_map(|p| p.ttft_p90_s)
        .filter(|v| *v > 0.0)
        .collect();
    let lo = ttfts.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = ttfts.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let (ly0, ly1) = if lo.is_finite() {
        let a = lo.log10().floor();
        let b = hi.log10().ceil().max(a + 1.0);
        (a, b)
    } else {
        (-1.0, 1.0)
    };
    let px = |i: usize| L + (i as f64 + 0.5) / n * (W - L - R);
    let py_t = |v: f64| T + (1.0 - (v.log10() - ly0) / (ly1 - ly0)) * (H - T - B);
    let py_h = |r: f64| T + (1.0 - r) * (H - T - B);
    // Axes and grid.
    let _ = write!(
        s,
        r##"<rect x="{L}" y="{T}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
        W - L - R,
        H - T - B
    );
    let mut e = ly0;
    while e <= ly1 + 1e-9 {
        let y = py_t(10f64.powf(e));
        let label = if e >= 0.0 {
            format!("{}", 10f64.powf(e))
        } else {
            format!("{:.*}", (-e) as usize, 10f64.powf(e))
        };
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end" fill="#1f77b4">{label}</text>"##,
            W - R,
            L - 6.0,
            y + 4.0
        );
        e += 1.0;
    }
    for i in 0..=4 {
        let r = f64::from(i) / 4.0;
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" fill="#d62728">{:.0}%</text>"##,
            W - R + 6.0,
            py_h(r) + 4.0,
            r * 100.0
        );
    }
    for (i, p) in points.iter().enumerate() {
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" text-anchor="middle">{}</text>"##,
            px(i),
            H - B + 18.0,
            p.value
        );
    }
    let _ = write!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle">{}</text>"##,
        (L + W - R) / 2.0,
        H - 16.0,
        esc(param.label())
    );
    let _ = write!(
        s,
        r##"<text transform="translate(20,{}) rotate(-90)" text-anchor="middle" fill="#1f77b4">TTFT p90 (s, log)</text>"##,
        (T + H - B) / 2.0
    );
    let _ = write!(
        s,
        r##"<text transform="translate({},{}) rotate(90)" text-anchor="middle" fill="#d62728">hit ratio</text>"##,
        W - 20.0,
        (T + H - B) / 2.0
    );
    // Series.
    let line = |pts: Vec<(f64, f64)>, color: &str, s: &mut String| {
        if pts.is_empty() {
            return;
        }
        let d: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = write!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            d.join(" ")
        );
        for (x, y) in pts {
            let _ = write!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
            );
        }
    };
    line(
        points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.ttft_p90_s.filter(|v| *v > 0.0).map(|v| (px(i), py_t(v))))
            .collect(),
        "#1f77b4",
        &mut s,
    );
    line(
        points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.hit_ratio.map(|h| (px(i), py_h(h))))
            .collect(),
        "#d62728",
        &mut s,
    );
    s.push_str("</svg>\n");
    s
}
