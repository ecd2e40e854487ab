//! Stop strings over streamed text: text that could still turn into a stop string is
//! held back until it cannot, so nothing past a stop is ever sent.

/// What a new piece of text released.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// Text safe to send (possibly empty).
    Emit(String),
    /// A stop string matched: send this text (what came before the stop) and end.
    Stop(String),
}

/// Finds stop strings across piece boundaries.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// A matcher for `stops` (may be empty).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, pending: String::new() }
    }

    /// Adds `piece`; returns what can be sent now.
    pub fn push(&mut self, piece: &str) -> Scan {
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return Scan::Emit(std::mem::take(&mut self.pending));
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let before = self.pending[..at].to_string();
            self.pending.clear();
            return Scan::Stop(before);
        }
        let hold = self.held_back();
        let cut = self.pending.len() - hold;
        let rest = self.pending.split_off(cut);
        Scan::Emit(std::mem::replace(&mut self.pending, rest))
    }

    /// The text held back at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Bytes at the end of `pending` that begin some stop string.
    fn held_back(&self) -> usize {
        let p = &self.pending;
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        (1..longest.min(p.len() + 1))
            .rev()
            .find(|&k| {
                p.is_char_boundary(p.len() - k) && self.stops.iter().any(|s| s.starts_with(&p[p.len() - k..]))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                Scan::Emit(t) => out.push_str(&t),
                Scan::Stop(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_across_pieces() {
        assert_eq!(run(&["END"], &["abc E", "N", "D more"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "N", "x"]), ("abc ENx".into(), false));
        assert_eq!(run(&["xy", "b"], &["aaxb"]), ("aax".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["\n\n".into()]);
        assert_eq!(m.push("a\n"), Scan::Emit("a".into()));
        assert_eq!(m.push("b"), Scan::Emit("\nb".into()));
    }
}
