//! Mooncake-format request traces (kvcache-ai/Mooncake, `FAST25-release/traces/`): one JSON
//! object per line with `timestamp` (ms from the start), `input_length`, `output_length`
//! (tokens) and `hash_ids`, the remapped prefix hashes of the prompt's **512-token** blocks
//! (equal ids at equal positions mean a shared prefix; the last block may be partial).
//!
//! # 512-token ids on 256-token blocks
//! A DeepSeek-V4 block is 256 tokens, so one trace id covers two pool blocks. Pool block
//! `i` of a prompt lies in trace block `i·256 / 512` at half `(i·256 mod 512) / 256`; its
//! content key is derived from (that id, that half), chained from the previous block's key
//! as every prefix is ([`crate::manager::chain_hashes`]'s rule, in `policy.rs`). Only pool
//! blocks that lie wholly inside the prompt take a trace-derived key: a block that reaches
//! into the output (whose tokens the trace does not name) gets a key of its own request, so
//! a partial last trace block never claims more sharing than the trace shows.
//!
//! The trace's **ceiling** ([`Trace::ceiling`]) is the reuse an infinite cache that kept
//! every earlier block would give, in the trace's own unit: for each request the longest
//! prefix of its ids that earlier requests' prompts carried, over all ids.

use super::RequestSpec;
use crate::file::{read_text_bounded, FileError};

crate::variant::variant_names! {
/// A trace line that cannot be read, with its 1-based line number.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TraceError {
    /// Not a JSON object with the four fields.
    #[error("trace line {line}: {reason}")]
    Line {
        /// The line.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Timestamps must not go backwards (the replay is in arrival order).
    #[error("trace line {line}: timestamp {ts} is before the previous line's {prev}")]
    OutOfOrder {
        /// The line.
        line: usize,
        /// Its timestamp.
        ts: u64,
        /// The previous one.
        prev: u64,
    },
    /// More lines than [`MAX_TRACE_REQUESTS`].
    #[error("trace has more than {MAX_TRACE_REQUESTS} requests")]
    TooLong,
    /// The file the bounded reader refused (unreadable, not a regular file, over
    /// [`MAX_TRACE_BYTES`], not UTF-8).
    #[error("trace: {0}")]
    File(#[from] FileError),
    /// A shard `k/n` with `n == 0` or `k >= n`.
    #[error("shard {0}/{1} is not k/n with k < n")]
    Shard(u64, u64),
    /// A replay speed that is not finite and positive.
    #[error("trace speed {0} is not a finite positive number")]
    Speed(f64),
}
}

/// Most requests one trace may hold (its ids are kept in memory: the conversation trace's
/// 12,031 requests take about 2 MiB).
pub const MAX_TRACE_REQUESTS: usize = 1 << 22;
/// Longest prompt or output a trace line may give (tokens).
pub const MAX_TRACE_TOKENS: u64 = 1 << 24;
/// Tokens one trace hash id covers.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input: u64,
    /// Output tokens.
    pub output: u64,
    /// Prefix hash ids of the prompt's 512-token blocks.
    pub ids: Vec<u64>,
}

/// A parsed trace, in arrival order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// Its requests.
    pub requests: Vec<TraceRequest>,
}

/// Requests of a trace carry this bit in [`RequestSpec::conv`]; the rest is the index into
/// [`Trace::requests`] (multiturn conversations and unique requests never set it).
pub const TRACE_CONV: u64 = 1 << 62;

/// Largest trace file [`Trace::from_path`] reads: room for [`MAX_TRACE_REQUESTS`] lines of
/// about 250 bytes (the conversation trace's 12,031 lines are under 3 MiB).
pub const MAX_TRACE_BYTES: u64 = 1 << 30;

impl Trace {
    /// Parse Mooncake JSONL. Blank lines are skipped; every other line must be an object
    /// with non-negative integer `timestamp`, `input_length`, `output_length` (at most
    /// [`MAX_TRACE_TOKENS`]) and an array of non-negative integer `hash_ids` no longer than
    /// the prompt's 512-token blocks; timestamps must not decrease. Other keys are ignored.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut requests = Vec::new();
        let mut prev = 0;
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            if requests.len() >= MAX_TRACE_REQUESTS {
                return Err(TraceError::TooLong);
            }
            let bad = |reason: String| TraceError::Line { line: line_no, reason };
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
            let field = |k: &str| -> Result<u64, TraceError> {
                v.get(k)
                    .and_then(serde_json::Value::as_u64)
                    .ok_or_else(|| bad(format!("{k} is not a non-negative integer")))
            };
            let (ts, input, output) = (field("timestamp")?, field("input_length")?, field("output_length")?);
            if input == 0 || input > MAX_TRACE_TOKENS || output > MAX_TRACE_TOKENS {
                return Err(bad(format!(
                    "lengths {input} / {output} are outside 1..={MAX_TRACE_TOKENS} / 0..={MAX_TRACE_TOKENS}"
                )));
            }
            let ids = v
                .get("hash_ids")
                .and_then(serde_json::Value::as_array)
                .ok_or_else(|| bad("hash_ids is not an array".into()))?
                .iter()
                .map(|h| h.as_u64().ok_or_else(|| bad("a hash id is not a non-negative integer".into())))
                .collect::<Result<Vec<u64>, _>>()?;
            if ids.len() as u64 > input.div_ceil(TRACE_BLOCK_TOKENS) {
                return Err(bad(format!("{} hash ids for {input} tokens", ids.len())));
            }
            if ts < prev {
                return Err(TraceError::OutOfOrder { line: line_no, ts, prev });
            }
            prev = ts;
            requests.push(TraceRequest { timestamp_ms: ts, input, output, ids });
        }
        Ok(Trace { requests })
    }

    /// Read (through the crate's one bounded reader, at most [`MAX_TRACE_BYTES`]) and parse
    /// a file.
    pub fn from_path(path: &std::path::Path) -> Result<Trace, TraceError> {
        Trace::parse(&read_text_bounded(path, MAX_TRACE_BYTES)?)
    }

    /// Only the requests of shard `k` of `n`: a conversation's turns share their leading ids,
    /// so routing by the first id past the common system prompt (`ids[1]`, or `ids[0]` for
    /// a one-block prompt) keeps a conversation on one shard, as a prefix-affinity router
    /// in front of `n` engines would.
    pub fn shard(&self, k: u64, n: u64) -> Result<Trace, TraceError> {
        if n == 0 || k >= n {
            return Err(TraceError::Shard(k, n));
        }
        let key = |r: &TraceRequest| r.ids.get(1).or(r.ids.first()).copied().unwrap_or(0);
        let requests =
            self.requests.iter().filter(|r| super::Rng::new(key(r)).next_u64() % n == k).cloned().collect();
        Ok(Trace { requests })
    }

    /// The ceiling (see the module docs): (ids an earlier prompt carried, in prefix order;
    /// all ids).
    pub fn ceiling(&self) -> (u64, u64) {
        let mut seen = std::collections::HashSet::new();
        let (mut hit, mut all) = (0u64, 0u64);
        for r in &self.requests {
            hit += r.ids.iter().take_while(|h| seen.contains(*h)).count() as u64;
            all += r.ids.len() as u64;
            seen.extend(r.ids.iter().copied());
        }
        (hit, all)
    }

    /// The requests as the engine takes them, arrivals divided by `speed` (1: as recorded).
    /// An output of 0 tokens is served as 1 (the engine always samples the first token).
    pub fn specs(&self, speed: f64) -> Result<Vec<RequestSpec>, TraceError> {
        if !(speed.is_finite() && speed > 0.0) {
            return Err(TraceError::Speed(speed));
        }
        Ok(self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| RequestSpec {
                id: i as u64,
                arrival: (r.timestamp_ms as f64 / speed) as u64,
                prompt: r.input,
                output: r.output.max(1),
                conv: TRACE_CONV | i as u64,
                system: 0,
                shared: 0,
            })
            .collect())
    }

    /// The hash ids of a request the engine got from [`Trace::specs`], if it is one.
    pub fn ids_of(&self, spec: &RequestSpec) -> Option<&[u64]> {
        if spec.conv & TRACE_CONV == 0 || spec.conv >> 63 != 0 {
            return None;
        }
        self.requests.get((spec.conv & !TRACE_CONV) as usize).map(|r| r.ids.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SNIPPET: &str = r#"{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 10, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]}

{"timestamp": 10, "input_length": 600, "output_length": 0, "hash_ids": [9, 1]}
"#;

    #[test]
    fn a_snippet_parses_and_its_ceiling_counts_prefix_ids() {
        let t = Trace::parse(SNIPPET).unwrap();
        assert_eq!(t.requests.len(), 3);
        assert_eq!(t.requests[1].ids, [0, 1, 3, 4]);
        // Second request: 0, 1 seen (2 of 4); third: 9 unseen, so 1 does not count.
        assert_eq!(t.ceiling(), (2, 9));
        let s = t.specs(2.0).unwrap();
        assert_eq!((s[1].arrival, s[2].output), (5, 1));
        assert_eq!(t.ids_of(&s[2]), Some(&[9u64, 1][..]));
        assert_eq!(t.ids_of(&RequestSpec::new(0, 0, 10, 10)), None);
    }

    #[test]
    fn bad_lines_are_typed_errors_with_their_line() {
        for (text, line) in [
            ("{\"timestamp\": 0}", 1),
            ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1, 2]}", 1),
            ("{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": []}", 1),
            ("\n{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}", 2),
            ("not json", 1),
        ] {
            match Trace::parse(text) {
                Err(TraceError::Line { line: l, .. }) => assert_eq!(l, line, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        let back = "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
                    {\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}";
        assert!(matches!(Trace::parse(back), Err(TraceError::OutOfOrder { line: 2, .. })));
        let t = Trace::parse(SNIPPET).unwrap();
        assert!(matches!(t.shard(2, 2), Err(TraceError::Shard(2, 2))));
        assert!(matches!(t.specs(0.0), Err(TraceError::Speed(_))));
    }

    #[test]
    fn shards_partition_the_trace_and_keep_a_conversation_together() {
        let t = Trace::parse(SNIPPET).unwrap();
        let parts: Vec<Trace> = (0..3).map(|k| t.shard(k, 3).unwrap()).collect();
        assert_eq!(parts.iter().map(|p| p.requests.len()).sum::<usize>(), 3);
        // The first two share ids[1] = 1, and so does the third: one shard holds all three.
        assert!(parts.iter().any(|p| p.requests.len() == 3));
    }
}
