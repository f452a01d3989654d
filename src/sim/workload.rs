//! Workload generation shared by the simulator, the benches and the tests: a seeded PRNG
//! (SplitMix64), the length mixes, and a lazy arrival stream.
//!
//! The stream draws one step's arrivals at a time, so a run holds only the requests that
//! have arrived and not yet finished — never the whole trace (`steps × rate` requests).
//! Two streams made from the same [`WorkloadConfig`] yield the same requests, which is how
//! the elastic and fixed runs see one workload.

// The workload's generator is the crate's one, defined at the bottom of the layering
// (src/rng.rs) so unit tests of every module can use it; public here as `sim::Rng`.
pub use crate::rng::Rng;

use super::SimConfigError;

/// Length mixes of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// Prompts around 1k tokens, outputs around 300.
    Chat,
    /// Long-context agentic work: prompts 32k..1M tokens (log-uniform), outputs 200..4k.
    Agentic,
    /// 90 % chat, 10 % agentic.
    Mixed,
    /// Conversations that re-send their growing history each turn (turn k+1's prompt
    /// extends turn k's prompt and output), opening with one of a few system prompts that
    /// conversations share.
    Multiturn,
}

impl Mix {
    /// `chat`, `agentic` or `mixed`; anything else is `None`.
    pub fn parse(s: &str) -> Option<Mix> {
        match s {
            "chat" => Some(Mix::Chat),
            "agentic" => Some(Mix::Agentic),
            "mixed" => Some(Mix::Mixed),
            "multiturn" => Some(Mix::Multiturn),
            _ => None,
        }
    }
    /// The shortest `max_context` whose every request of the mix fits: a one-token prompt and
    /// one output token, or, where the mix draws agentic requests, an
    /// [`AGENTIC_PROMPTS`]-floor prompt and one output token. A workload's `max_context` caps
    /// the lengths it draws but never below their floor ([`Workload::new`] refuses it).
    pub fn min_context(self) -> u64 {
        match self {
            Mix::Chat | Mix::Multiturn => 2,
            Mix::Agentic | Mix::Mixed => AGENTIC_PROMPTS.0 + 1,
        }
    }
    /// The name [`Mix::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Chat => "chat",
            Mix::Agentic => "agentic",
            Mix::Mixed => "mixed",
            Mix::Multiturn => "multiturn",
        }
    }
}

/// One request of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    /// Arrival order, from 0.
    pub id: u64,
    /// The step it arrives at.
    pub arrival: u64,
    /// Prompt tokens.
    pub prompt: u64,
    /// Tokens to generate.
    pub output: u64,
    /// Whose tokens these are: token `p` of a request is a function of (`conv`, `p`), or of
    /// (`system`, `p`) for `p < shared`. Turns of one conversation share `conv`; requests
    /// of the other mixes each have their own.
    pub conv: u64,
    /// The shared system prompt the request opens with (meaningful when `shared > 0`).
    pub system: u64,
    /// Leading prompt tokens that are the shared system prompt.
    pub shared: u64,
}

impl RequestSpec {
    /// A request whose tokens are its own (no shared prefix with any other request).
    pub fn new(id: u64, arrival: u64, prompt: u64, output: u64) -> RequestSpec {
        RequestSpec { id, arrival, prompt, output, conv: UNIQUE_CONV | id, system: 0, shared: 0 }
    }
}

/// The agentic requests' prompt range, tokens (log-uniform, capped by `max_context − 1`).
pub const AGENTIC_PROMPTS: (u64, u64) = (32 << 10, 1 << 20);

/// Conversation ids of requests that share nothing carry this bit (multiturn conversations
/// count up from 0 without it).
const UNIQUE_CONV: u64 = 1 << 63;
/// Shared system prompts of the multiturn mix, and their length in tokens.
const SYSTEMS: u64 = 4;
const SYSTEM_TOKENS: u64 = 2048;
/// Most conversations open at once, and most turns one conversation takes.
const MAX_OPEN: usize = 256;
const MAX_TURNS: u32 = 8;

/// An open multiturn conversation: the history its next turn re-sends.
#[derive(Clone, Copy, Debug)]
struct Conversation {
    conv: u64,
    system: u64,
    /// Tokens of history (every earlier prompt and output).
    history: u64,
    turns: u32,
}

/// What the arrival stream is drawn from.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct WorkloadConfig {
    /// Length mix.
    pub mix: Mix,
    /// Mean arrivals per step (Poisson).
    pub rate: f64,
    /// Steps that see arrivals.
    pub steps: u64,
    /// PRNG seed.
    pub seed: u64,
    /// Longest context (prompt + output) a request may reach.
    pub max_context: u64,
}

impl WorkloadConfig {
    /// `steps` steps of `mix` arrivals at `rate` per step from `seed`, contexts up to
    /// `max_context` ([`crate::sim::SimConfig::workload_config`] takes them from a run's config).
    pub fn new(mix: Mix, rate: f64, steps: u64, seed: u64, max_context: u64) -> Self {
        WorkloadConfig { mix, rate, steps, seed, max_context }
    }
}

/// The arrival stream, drawn lazily in arrival order (see the module docs).
#[derive(Clone, Debug)]
pub struct Workload {
    cfg: WorkloadConfig,
    rng: Rng,
    /// The step whose arrivals are being drawn, and how many of them are left.
    step: u64,
    left: u64,
    next_id: u64,
    /// Open multiturn conversations (at most `MAX_OPEN`).
    open: Vec<Conversation>,
    next_conv: u64,
}

impl Workload {
    /// A stream for `cfg`; nothing is drawn until it is iterated. A `max_context` shorter
    /// than the mix's requests can be ([`Mix::min_context`]) is refused.
    pub fn new(cfg: WorkloadConfig) -> Result<Workload, SimConfigError> {
        let min = cfg.mix.min_context();
        if cfg.max_context < min {
            return Err(SimConfigError::ContextBelowMix { mix: cfg.mix.name(), got: cfg.max_context, min });
        }
        Ok(Workload {
            rng: Rng::new(cfg.seed),
            cfg,
            step: 0,
            left: 0,
            next_id: 0,
            open: Vec::new(),
            next_conv: 0,
        })
    }

    /// The configuration the stream draws from.
    pub fn config(&self) -> &WorkloadConfig {
        &self.cfg
    }

    /// One request's lengths. The draw order (agentic coin, prompt, output) is the
    /// workload's definition: changing it changes every seed's trace.
    fn draw(&mut self) -> (u64, u64) {
        let cap = self.cfg.max_context; // at least the mix's min_context (`new`)
        let rng = &mut self.rng;
        let agentic = match self.cfg.mix {
            Mix::Chat | Mix::Multiturn => false,
            Mix::Agentic => true,
            Mix::Mixed => rng.f64() < 0.1,
        };
        let (prompt, output) = if agentic {
            let (lo, hi) = AGENTIC_PROMPTS;
            (rng.log_uniform(lo, cap.min(hi)), rng.log_uniform(200, 4096))
        } else {
            (rng.lognormal(1000.0, 0.8, 16, 16384), rng.lognormal(300.0, 0.7, 16, 4096))
        };
        let prompt = prompt.min(cap - 1);
        (prompt, output.min(cap - prompt).max(1))
    }
}

impl Iterator for Workload {
    type Item = RequestSpec;

    fn next(&mut self) -> Option<RequestSpec> {
        // `step` is one past the step being drawn once its count is known.
        while self.left == 0 {
            if self.step >= self.cfg.steps {
                return None;
            }
            self.left = self.rng.poisson(self.cfg.rate);
            self.step += 1;
        }
        self.left -= 1;
        let id = self.next_id;
        self.next_id += 1;
        let arrival = self.step - 1;
        if self.cfg.mix == Mix::Multiturn {
            return Some(self.turn(id, arrival));
        }
        let (prompt, output) = self.draw();
        Some(RequestSpec::new(id, arrival, prompt, output))
    }
}

impl Workload {
    /// The next multiturn request: a new conversation (a system prompt and a first user
    /// message) or the next turn of an open one (its whole history and a new message).
    fn turn(&mut self, id: u64, arrival: u64) -> RequestSpec {
        let cap = self.cfg.max_context; // at least the mix's min_context (`new`)
        let (message, output) = self.draw();
        let rng = &mut self.rng;
        let continue_one = !self.open.is_empty() && (self.open.len() >= MAX_OPEN || rng.f64() < 0.75);
        let (i, c) = if continue_one {
            let i = rng.range(0, self.open.len() as i64) as usize;
            (i, self.open[i])
        } else {
            let c =
                Conversation { conv: self.next_conv, system: rng.next_u64() % SYSTEMS, history: 0, turns: 0 };
            self.next_conv += 1;
            self.open.push(c);
            (self.open.len() - 1, c)
        };
        let shared = SYSTEM_TOKENS.min(cap - 1);
        let prompt = if c.turns == 0 { shared + message } else { c.history + message }.min(cap - 1);
        let output = output.min(cap - prompt).max(1);
        let next = Conversation { history: prompt + output, turns: c.turns + 1, ..c };
        if next.turns >= MAX_TURNS || next.history + 2 >= cap {
            self.open.swap_remove(i);
        } else {
            self.open[i] = next;
        }
        RequestSpec {
            id,
            arrival,
            prompt,
            output,
            conv: c.conv,
            system: c.system,
            shared: shared.min(prompt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_is_deterministic_and_bounded() {
        let cfg = WorkloadConfig { mix: Mix::Mixed, rate: 0.5, steps: 500, seed: 7, max_context: 1 << 20 };
        let a: Vec<RequestSpec> = Workload::new(cfg).unwrap().collect();
        let b: Vec<RequestSpec> = Workload::new(cfg).unwrap().collect();
        assert_eq!(a, b);
        assert!(!a.is_empty());
        for (i, r) in a.iter().enumerate() {
            assert_eq!(r.id, i as u64);
            assert!(r.prompt >= 1 && r.output >= 1 && r.prompt + r.output <= cfg.max_context);
            assert!(r.arrival < cfg.steps);
        }
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival), "arrivals out of order");
        let mean = a.len() as f64 / cfg.steps as f64;
        assert!((mean - cfg.rate).abs() < 0.15, "arrival rate {mean} far from {}", cfg.rate);
    }
}
