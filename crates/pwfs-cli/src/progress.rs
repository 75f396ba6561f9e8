//! Progress on a terminal: bars for mkfs and fsck, a spinner for the benchmarks. Drawn
//! on stderr only when it is a terminal; otherwise the bars stay hidden and the
//! benchmarks print one line per step, as they always did.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;

/// A bar counting blocks (hidden unless stderr is a terminal); `update` is the engine's
/// progress callback for it.
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new(what: &str) -> Bar {
        // Drawn from the first update on, once the total is known.
        let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        pb.set_style(
            ProgressStyle::with_template("{msg} [{wide_bar}] {pos}/{len} blocks, {elapsed}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        pb.set_message(what.to_string());
        Bar(pb)
    }

    /// `done` of `total` blocks (the total may grow as the work finds out more).
    pub fn update(&self, done: u64, total: u64) {
        if self.0.length().is_none() {
            self.0.set_draw_target(ProgressDrawTarget::stderr());
        }
        self.0.set_length(total);
        self.0.set_position(done);
    }

    pub fn finish(self) {
        self.0.finish_and_clear();
    }
}

/// The benchmarks' step messages: a spinner showing the current one on a terminal,
/// a line per step otherwise.
pub struct Steps {
    prefix: String,
    spinner: Option<ProgressBar>,
}

impl Steps {
    pub fn new(prefix: &str) -> Steps {
        let spinner = std::io::stderr().is_terminal().then(|| {
            let s = ProgressBar::new_spinner();
            s.set_style(ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("a valid template"));
            s.set_message(format!("{prefix}..."));
            s.enable_steady_tick(Duration::from_millis(120));
            s
        });
        Steps { prefix: prefix.to_string(), spinner }
    }

    pub fn step(&mut self, s: &str) {
        match &self.spinner {
            Some(sp) => sp.set_message(format!("{}: {s}...", self.prefix)),
            None => eprintln!("{}: {s}...", self.prefix),
        }
    }

    pub fn finish(self) {
        if let Some(sp) = self.spinner {
            sp.finish_and_clear();
        }
    }
}
