//! What a simulation reports: every figure of a run, memory samples, latency statistics.

/// Memory by region at one step, in plane rows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// The step sampled.
    pub step: u64,
    /// The clock at that step, ms (0 when the run counts steps).
    pub time_ms: f64,
    /// Rows of blocks held by requests.
    pub block_rows_used: i64,
    /// Rows of free blocks.
    pub block_rows_free: i64,
    /// Rows of slots held by requests.
    pub slot_rows_used: i64,
    /// Rows of free slots.
    pub slot_rows_free: i64,
    /// Rows between the block region and the slot region.
    pub gap_rows: i64,
    /// Requests running.
    pub running: usize,
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Compressed history held by running requests (their blocks × block size).
    pub compressed_tokens: u64,
}

/// Latencies in a fixed number of log-spaced buckets (1 % wide, from 0.01 to ~3·10⁷ units:
/// µs for index builds, ms for request latencies), so a run of any length keeps the same
/// few kilobytes. Percentiles are exact to a bucket.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    n: u64,
    sum: f64,
    max: f64,
}

const HIST_MIN_US: f64 = 0.01;
const HIST_GROWTH: f64 = 1.01;
const HIST_BUCKETS: usize = 2200;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram { counts: vec![0; HIST_BUCKETS], n: 0, sum: 0.0, max: 0.0 }
    }
}

impl LatencyHistogram {
    /// Count one latency in microseconds (negative or NaN counts as 0).
    pub fn record(&mut self, us: f64) {
        let us = if us.is_nan() { 0.0 } else { us.max(0.0) };
        let b = if us <= HIST_MIN_US { 0.0 } else { (us / HIST_MIN_US).ln() / HIST_GROWTH.ln() };
        self.counts[(b as usize).min(HIST_BUCKETS - 1)] += 1;
        self.n += 1;
        self.sum += us;
        self.max = self.max.max(us);
    }
    /// Latencies recorded.
    pub fn count(&self) -> u64 {
        self.n
    }
    /// Mean (exact), 0 when empty.
    pub fn mean(&self) -> f64 {
        self.sum / self.n.max(1) as f64
    }
    /// Largest (exact), 0 when empty.
    pub fn max(&self) -> f64 {
        self.max
    }
    /// The cumulative distribution as (value, fraction at or below it) at each bucket that
    /// holds a count: at most the histogram's bucket count of points.
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let mut seen = 0;
        let n = self.n.max(1) as f64;
        let mut out = Vec::new();
        for (i, c) in self.counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            seen += c;
            out.push(((HIST_MIN_US * HIST_GROWTH.powi(i as i32 + 1)).min(self.max), seen as f64 / n));
        }
        out
    }
    /// Add every latency `other` counted (the fleet's histogram from its engines').
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }
    /// The `q`-quantile (0..=1): the upper edge of the bucket holding it, capped at the max.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let rank = ((self.n as f64 * q.clamp(0.0, 1.0)).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return (HIST_MIN_US * HIST_GROWTH.powi(i as i32 + 1)).min(self.max);
            }
        }
        self.max
    }
}

/// Every figure one run produces.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// The run: `elastic`, `fixed`, `no_reuse` or `reuse_4096`.
    pub policy: String,
    /// The backend, with its device name when that says more.
    pub backend: String,
    /// Steps run.
    pub steps: u64,
    /// Requests that arrived (turned-away ones included).
    pub arrived: u64,
    /// Requests that finished.
    pub completed: u64,
    /// Requests refused at admission because they could never fit the pool.
    pub refused: u64,
    /// Arrivals turned away because the queue held [`super::MAX_WAITING`] requests.
    pub turned_away: u64,
    /// Tokens decoded.
    pub generated_tokens: u64,
    /// Prompt tokens prefilled (re-prefills after preemption included).
    pub prefilled_tokens: u64,
    /// Running requests freed and re-queued for lack of blocks.
    pub preemptions: u64,
    /// Prompt tokens served from the cache ÷ prompt tokens an earlier request had already
    /// prefilled (cached now or not), over first admissions.
    pub prefix_hit_rate: f64,
    /// The hit rate's numerator: tokens served from the cache at first admissions.
    pub prefix_hit_tokens: u64,
    /// The hit rate's denominator: prompt tokens an earlier request had committed.
    pub eligible_prefix_tokens: u64,
    /// Prefill tokens not computed thanks to hits (re-admissions included).
    pub prefill_tokens_saved: u64,
    /// Prefill tokens computed again after a preemption.
    pub recomputed_prefill_tokens: u64,
    /// Admissions that hit.
    pub hits: u64,
    /// Checkpoint stores queued.
    pub checkpoints_stored: u64,
    /// Checkpoint image bytes held at the end.
    pub checkpoint_bytes_held: u64,
    /// Most checkpoint image bytes held at once.
    pub max_checkpoint_bytes: u64,
    /// Cached blocks evicted.
    pub evicted_blocks: u64,
    /// Checkpoints evicted from the LRU.
    pub evicted_checkpoints: u64,
    /// Most requests running at once.
    pub max_running: usize,
    /// Mean requests running per step.
    pub mean_running: f64,
    /// Most compressed history held at once (tokens).
    pub max_compressed_tokens: u64,
    /// Mean compressed history held per step (tokens).
    pub mean_compressed_tokens: f64,
    /// Boundary moves.
    pub boundary_moves: u64,
    /// Blocks relocated by boundary moves.
    pub block_relocations: u64,
    /// Slots relocated by boundary moves.
    pub slot_relocations: u64,
    /// Mean steps a request waited, over admissions (re-admissions included, each counted
    /// from the request's arrival). Requests never admitted do not count, so in an overloaded
    /// run a policy that admits more of the queue's tail reads worse here.
    pub mean_wait_steps: f64,
    /// Mean steps a request spent queued, over every request that entered the queue (refused
    /// ones aside): each stay from arrival or preemption to admission, and a request still
    /// queued at the end with its wait so far. A request admitted no later under one policy
    /// than under another never raises this figure.
    pub mean_queue_steps: f64,
    /// Decode steps that built indices.
    pub index_build_steps: u64,
    /// Index build, mean µs.
    pub index_build_mean_us: f64,
    /// Index build, 99th percentile µs (to a 1 % bucket).
    pub index_build_p99_us: f64,
    /// Index build, max µs.
    pub index_build_max_us: f64,
    /// Host staging of the step's metadata (with block tables), mean per step.
    pub stage_mean_us: f64,
    /// Rows of one plane.
    pub plane_rows: i64,
    /// Rows of one block's envelope.
    pub envelope_rows: i64,
    /// Rows of one slot.
    pub slot_rows: i64,
    /// Memory by region over the run (at most [`super::MAX_SAMPLES`]).
    pub samples: Vec<Sample>,
    /// Final row space: (num_blocks, used blocks, num_slots, used slots).
    pub final_split: (u32, u32, u32, u32),
    /// Prompt tokens of first admissions (the hit rate over all input is
    /// `prefix_hit_tokens / input_tokens`).
    pub input_tokens: u64,
    /// The figures in time, when the run had a step-cost model.
    pub time: Option<TimeReport>,
}

/// What a run in time reports (latencies in ms).
#[derive(Clone, Debug, Default)]
pub struct TimeReport {
    /// The cost model's name.
    pub cost: String,
    /// GPUs the throughput is divided by.
    pub gpus: u32,
    /// The clock at the end, s (the last completion when the run drained).
    pub duration_s: f64,
    /// Time to first token of every request that got one, and of every request still
    /// waiting for one at the end with its wait so far (a lower bound, counted in
    /// `ttft_censored`).
    pub ttft_ms: LatencyHistogram,
    /// Requests whose TTFT is a lower bound (no first token when the run stopped).
    pub ttft_censored: u64,
    /// Time per output token of completed requests, (finish − first token) / (output − 1).
    pub tpot_ms: LatencyHistogram,
    /// Arrival (or send, in a closed loop) to finish, completed requests.
    pub e2e_ms: LatencyHistogram,
    /// Input + output tokens of completed requests per second per GPU.
    pub tok_s_gpu: f64,
    /// Output tokens of completed requests per second per GPU.
    pub out_tok_s_gpu: f64,
    /// Requests that completed within the latency target, per second.
    pub goodput_rps: f64,
    /// Their input + output tokens per second per GPU.
    pub goodput_tok_s_gpu: f64,
    /// Completed requests that met the target.
    pub within_slo: u64,
    /// The target: TTFT, ms.
    pub slo_ttft_ms: f64,
    /// The target: TPOT, ms.
    pub slo_tpot_ms: f64,
    /// Busy time (steps run) over the clock.
    pub busy: f64,
    /// Host-tier bytes restored (charged at the model's host bandwidth).
    pub restored_bytes: u64,
}

impl TimeReport {
    /// (p50, p90, p99) of a histogram.
    pub fn percentiles(h: &LatencyHistogram) -> (f64, f64, f64) {
        (h.quantile(0.5), h.quantile(0.9), h.quantile(0.99))
    }
}

#[cfg(test)]
mod tests {
    use super::LatencyHistogram;

    #[test]
    fn histogram_quantiles_are_within_a_bucket() {
        let mut h = LatencyHistogram::default();
        assert_eq!((h.count(), h.mean(), h.max(), h.quantile(0.99)), (0, 0.0, 0.0, 0.0));
        // 1..=1000 µs in a scrambled order: the histogram does not care about order.
        for i in 0..1000u64 {
            h.record(((i * 617) % 1000 + 1) as f64);
        }
        assert_eq!(h.count(), 1000);
        assert!((h.mean() - 500.5).abs() < 1e-9);
        assert_eq!(h.max(), 1000.0);
        for (q, exact) in [(0.5, 500.0), (0.99, 990.0), (1.0, 1000.0)] {
            let got = h.quantile(q);
            assert!(got >= exact && got <= exact * 1.0101, "q{q}: {got} vs {exact}");
        }
        h.record(f64::NAN);
        h.record(-3.0);
        h.record(1e12);
        assert_eq!(h.count(), 1003);
        // NaN and negatives count as 0: the two lowest ranks sit in the first bucket.
        assert!(h.quantile(2.0 / 1003.0) <= 0.0102, "{}", h.quantile(2.0 / 1003.0));
        assert!(h.quantile(3.0 / 1003.0) >= 1.0);
    }
}
