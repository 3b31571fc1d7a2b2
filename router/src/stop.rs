//! Stop sequences matched on the detokenized stream. Text that could still be
//! the start of a stop sequence is held back, so a stop string split across
//! tokens never leaks to the client.

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released to the client.
    pending: String,
}

#[derive(Debug, PartialEq, Eq)]
pub enum StopResult {
    /// Text that is safe to release now.
    Continue(String),
    /// A stop sequence matched: release the text before it and finish.
    Stopped { text: String, stop: String },
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, pending: String::new() }
    }

    pub fn push(&mut self, text: &str) -> StopResult {
        if self.stops.is_empty() {
            return StopResult::Continue(text.to_string());
        }
        self.pending.push_str(text);
        // Earliest match wins; among matches at one position, the longest.
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            if let Some(at) = self.pending.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((b, bs)) => at < b || (at == b && s.len() > bs.len()),
                };
                if better {
                    best = Some((at, s));
                }
            }
        }
        if let Some((at, stop)) = best {
            let stop = stop.clone();
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return StopResult::Stopped { text, stop };
        }
        let hold = self.longest_partial_suffix();
        let release_to = self.pending.len() - hold;
        let released = self.pending[..release_to].to_string();
        self.pending.drain(..release_to);
        StopResult::Continue(released)
    }

    /// Held-back text, released when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop.
    fn longest_partial_suffix(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            let max = s.len().saturating_sub(1).min(self.pending.len());
            for n in (best + 1..=max).rev() {
                let start = self.pending.len() - n;
                if self.pending.is_char_boundary(start) && s.starts_with(&self.pending[start..]) {
                    best = n;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopResult::Continue(t) => out.push_str(&t),
                StopResult::Stopped { text, stop } => {
                    out.push_str(&text);
                    return (out, Some(stop));
                }
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
    }

    #[test]
    fn stop_split_across_tokens_is_excluded() {
        assert_eq!(run(&["###"], &["hello #", "#", "# world"]), ("hello ".into(), Some("###".into())));
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        let mut m = StopMatcher::new(vec!["abc".into()]);
        assert_eq!(m.push("xa"), StopResult::Continue("x".into()));
        assert_eq!(m.push("b"), StopResult::Continue("".into()));
        assert_eq!(m.push("d"), StopResult::Continue("abd".into()));
    }

    #[test]
    fn earliest_stop_wins() {
        assert_eq!(run(&["world", "lo"], &["hello world"]), ("hel".into(), Some("lo".into())));
    }

    #[test]
    fn held_text_is_flushed_at_end() {
        assert_eq!(run(&["END"], &["the E"]), ("the E".into(), None));
    }

    #[test]
    fn multibyte_text_is_safe() {
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), Some("é!".into())));
        assert_eq!(run(&["日本"], &["こんにちは日", "x"]), ("こんにちは日x".into(), None));
    }
}
