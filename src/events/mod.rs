//! KV events for routers (issue 35, docs/fleet.md §2): what the manager reports
//! ([`KvManager::drain_events`]) published the way vLLM publishes its own, so llm-d's
//! `kv-cache` router, NVIDIA Dynamo's KV router, or a subscriber written from vLLM's event
//! classes reads v4pool's engines like vLLM ones.
//!
//! * **Transport** (vLLM's `ZmqEventPublisher`): a ZeroMQ PUB socket sends each batch as a
//!   multipart message `[topic, seq (u64 big-endian), payload]`, seq counting batches from 0;
//!   the socket binds when the endpoint has a wildcard (`*`, `::`) or is `ipc://` /
//!   `inproc://`, and connects otherwise. An optional **replay** ROUTER socket answers a
//!   request `[start seq (8 bytes big-endian)]` (from a REQ or DEALER client) with every
//!   buffered batch from that seq as `[topic, seq, payload]` and then `["", -1 (8 bytes), ""]`;
//!   the last [`KvEventsConfig::buffer_batches`] batches are kept for it.
//! * **Payload**: [`wire`] — `[ts, [events], dp_rank]` in MessagePack, each event a tagged
//!   array or a tagged map ([`EventEncoding`], a setting: the routers differ), block hashes
//!   the low 64 bits of v4pool's chained hashes, `medium` `GPU` / `CPU` / `STORAGE` per tier.
//! * **Inbound bound**: both sockets disconnect a peer sending a frame longer than
//!   [`MAX_INBOUND_FRAME`] (subscriptions and replay requests are a few bytes), so no peer
//!   makes the engine hold more than that per frame.
//! * **libzmq** is loaded at run time ([`zmq`](mod@zmq)); without it every call is
//!   [`EventsError::ZmqUnavailable`] and the rest of v4pool is unaffected.

pub mod wire;
pub mod zmq;

use crate::manager::{KvEvent, KvManager};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
pub use wire::{encode_batch, wire_hash, EventEncoding};

crate::variant::variant_names! {
/// What publishing refuses or fails with.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// libzmq could not be loaded (not installed, or `V4POOL_ZMQ_LIB` names no libzmq).
    #[error("KV events need libzmq: {0}")]
    ZmqUnavailable(String),
    /// A libzmq call failed.
    #[error("{call}: {message}")]
    Zmq {
        /// The call.
        call: &'static str,
        /// libzmq's description.
        message: String,
    },
    /// An endpoint or topic with a NUL byte.
    #[error("endpoint {0:?} contains a NUL byte")]
    BadEndpoint(String),
    /// The replay thread could not start or stopped.
    #[error("replay socket: {0}")]
    Replay(String),
    /// A replay answer that is not `[topic, seq, payload]` frames ending with the end marker.
    #[error("malformed replay answer: {0}")]
    BadReplay(&'static str),
}
}

/// Where and how a publisher sends (vLLM's `KVEventsConfig`, plus the encoding).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvEventsConfig {
    /// The PUB socket's endpoint (vLLM's default `tcp://*:5557`).
    pub endpoint: String,
    /// The replay ROUTER socket's endpoint (always bound), or none.
    pub replay_endpoint: Option<String>,
    /// The first frame of every message (llm-d parses `kv@<pod>@<model>`).
    pub topic: String,
    /// How events are encoded ([`EventEncoding`]).
    pub encoding: EventEncoding,
    /// The engine's data-parallel rank (the batch's third field).
    pub dp_rank: u32,
    /// Tokens per block (the manager's [`KvManager::block_size`]).
    pub block_size: u32,
    /// Batches kept for replay (vLLM's `buffer_steps`, 10,000).
    pub buffer_batches: usize,
    /// The PUB socket's send high-water mark (vLLM's 100,000).
    pub hwm: i32,
}

crate::setters::with_setters!(KvEventsConfig {
    with_endpoint(endpoint: String),
    with_replay_endpoint(replay_endpoint: Some(String)),
    with_topic(topic: String),
    with_encoding(encoding: EventEncoding),
    with_dp_rank(dp_rank: u32),
    with_block_size(block_size: u32),
    with_buffer_batches(buffer_batches: usize),
    with_hwm(hwm: i32),
});

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            encoding: EventEncoding::default(),
            dp_rank: 0,
            block_size: 256,
            buffer_batches: 10_000,
            hwm: 100_000,
        }
    }
}

/// vLLM's rule: bind a wildcard or local endpoint, connect to anything else.
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The longest frame a peer may send the publisher's sockets (libzmq disconnects it
/// otherwise, before holding the frame): a subscription is a topic prefix, a replay request
/// 8 bytes, a ZMTP READY command a socket type and a routing id of at most 255 bytes — 4 KiB
/// fits every honest one many times over. Unbounded, one peer subscribing with a 16 MiB prefix
/// made the PUB socket build 1.5 GiB of subscription trie, and each half-sent 64 MiB frame
/// kept 64 MiB resident for as long as its peer waited (issue 43 row 3).
pub const MAX_INBOUND_FRAME: usize = 4096;

/// The replay marker that ends an answer: -1 as 8 bytes big-endian.
pub const END_SEQ: [u8; 8] = [0xff; 8];

type Buffer = Arc<Mutex<VecDeque<(u64, Arc<[u8]>)>>>;

/// A ZeroMQ publisher of KV event batches (see the module docs). Dropping it stops the
/// replay thread and closes both sockets.
pub struct KvEventPublisher {
    config: KvEventsConfig,
    endpoint: String,
    replay_endpoint: Option<String>,
    pub_socket: zmq::Socket,
    seq: u64,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
    replay: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("seq", &self.seq)
            .finish()
    }
}

impl KvEventPublisher {
    /// Open the sockets of `config` (the replay socket in a thread of its own, which owns it).
    pub fn new(config: KvEventsConfig) -> Result<KvEventPublisher, EventsError> {
        let ctx = Arc::new(zmq::Context::new()?);
        let pub_socket = ctx.socket(zmq::PUB)?;
        pub_socket.set_send_hwm(config.hwm)?;
        // Subscriptions are inbound messages on a PUB socket: bound them like any other.
        pub_socket.set_max_inbound_frame(MAX_INBOUND_FRAME)?;
        let endpoint = if binds(&config.endpoint) {
            pub_socket.bind(&config.endpoint)?;
            pub_socket.last_endpoint()?
        } else {
            pub_socket.connect(&config.endpoint)?;
            config.endpoint.clone()
        };
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (mut replay, mut replay_endpoint) = (None, None);
        if let Some(at) = &config.replay_endpoint {
            let (tx, rx) = std::sync::mpsc::channel();
            let (ctx, at, buf, stop, topic) =
                (ctx.clone(), at.clone(), buffer.clone(), stop.clone(), config.topic.clone().into_bytes());
            let hwm = i32::try_from(2 * (config.buffer_batches + 1)).unwrap_or(i32::MAX);
            let handle = std::thread::Builder::new()
                .name("v4pool-kv-replay".into())
                .spawn(move || {
                    let opened = ctx.socket(zmq::ROUTER).and_then(|s| {
                        s.set_send_hwm(hwm)?;
                        s.set_max_inbound_frame(MAX_INBOUND_FRAME)?;
                        s.bind(&at)?;
                        let bound = s.last_endpoint()?;
                        Ok((s, bound))
                    });
                    match opened {
                        Ok((s, bound)) => {
                            let _ = tx.send(Ok(bound));
                            serve_replay(&s, &buf, &stop, &topic);
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                })
                .map_err(|e| EventsError::Replay(e.to_string()))?;
            match rx.recv() {
                Ok(Ok(bound)) => replay_endpoint = Some(bound),
                Ok(Err(e)) => {
                    let _ = handle.join();
                    return Err(e);
                }
                Err(_) => return Err(EventsError::Replay("the thread stopped before binding".into())),
            }
            replay = Some(handle);
        }
        Ok(KvEventPublisher { config, endpoint, replay_endpoint, pub_socket, seq: 0, buffer, stop, replay })
    }

    /// The PUB endpoint (a bound wildcard port resolved: what subscribers connect to).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
    /// The replay endpoint, bound, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }
    /// The next batch's sequence number (batches sent so far).
    pub fn next_seq(&self) -> u64 {
        self.seq
    }
    /// The configuration.
    pub fn config(&self) -> &KvEventsConfig {
        &self.config
    }

    /// Send `events` as one batch (nothing when empty); its sequence number.
    pub fn publish(&mut self, events: &[KvEvent]) -> Result<Option<u64>, EventsError> {
        if events.is_empty() {
            return Ok(None);
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let c = &self.config;
        let payload: Arc<[u8]> = encode_batch(ts, events, c.dp_rank, c.encoding, c.block_size).into();
        let seq = self.seq;
        self.pub_socket.send_multipart(&[c.topic.as_bytes(), &seq.to_be_bytes(), &payload])?;
        self.seq += 1;
        let mut b = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        b.push_back((seq, payload));
        while b.len() > self.config.buffer_batches {
            b.pop_front();
        }
        Ok(Some(seq))
    }

    /// Take the manager's pending events ([`KvManager::drain_events`]) and send them as one
    /// batch; the batch's sequence number, if there was anything.
    pub fn publish_from(&mut self, m: &mut KvManager) -> Result<Option<u64>, EventsError> {
        let events = m.drain_events();
        self.publish(&events)
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.replay.take() {
            let _ = h.join();
        }
    }
}

/// The replay thread's loop: answer requests until `stop` (checked every 50 ms).
fn serve_replay(s: &zmq::Socket, buf: &Buffer, stop: &AtomicBool, topic: &[u8]) {
    while !stop.load(Ordering::Relaxed) {
        match s.poll_in(50) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => return,
        }
        // [client id, empty delimiter, start seq] (a REQ client's too): a fourth frame is
        // already not a request.
        let Ok(frames) = s.recv_multipart(MAX_INBOUND_FRAME, 3) else { continue };
        // Anything else is ignored, as vLLM does.
        let [id, _, start] = frames.as_slice() else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else { continue };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Arc<[u8]>)> = {
            let b = buf.lock().unwrap_or_else(|e| e.into_inner());
            b.iter().filter(|(seq, _)| *seq >= start).cloned().collect()
        };
        for (seq, payload) in batches {
            if s.send_multipart(&[id, b"", topic, &seq.to_be_bytes(), &payload]).is_err() {
                break;
            }
        }
        let _ = s.send_multipart(&[id, b"", b"", &END_SEQ, b""]);
    }
}

/// One message a subscriber received: `(topic, seq, payload)`.
pub type EventMessage = (Vec<u8>, u64, Vec<u8>);

/// A subscriber of a [`KvEventPublisher`] (or of vLLM's): a SUB socket, and replay requests
/// over a DEALER socket. For tests and tools; routers bring their own.
pub struct KvEventSubscriber {
    ctx: Arc<zmq::Context>,
    sub: zmq::Socket,
}

/// Frames a message may carry (a batch of a few thousand events fits many times over).
const MAX_FRAME: usize = 64 << 20;

fn split(frames: Vec<Vec<u8>>) -> Result<EventMessage, EventsError> {
    let [topic, seq, payload]: [Vec<u8>; 3] =
        frames.try_into().map_err(|_| EventsError::BadReplay("not 3 frames"))?;
    let seq = <[u8; 8]>::try_from(seq.as_slice())
        .map_err(|_| EventsError::BadReplay("a seq of other than 8 bytes"))?;
    Ok((topic, u64::from_be_bytes(seq), payload))
}

impl KvEventSubscriber {
    /// Connect to `endpoint`, subscribed to messages whose topic starts with `topic`.
    pub fn connect(endpoint: &str, topic: &str) -> Result<KvEventSubscriber, EventsError> {
        let ctx = Arc::new(zmq::Context::new()?);
        let sub = ctx.socket(zmq::SUB)?;
        sub.set_max_inbound_frame(MAX_FRAME)?;
        sub.subscribe(topic.as_bytes())?;
        sub.connect(endpoint)?;
        Ok(KvEventSubscriber { ctx, sub })
    }

    /// The next message, or `None` after `timeout_ms` without one.
    pub fn recv(&self, timeout_ms: i64) -> Result<Option<EventMessage>, EventsError> {
        if !self.sub.poll_in(timeout_ms)? {
            return Ok(None);
        }
        split(self.sub.recv_multipart(MAX_FRAME, 3)?).map(Some)
    }

    /// Ask the replay socket at `endpoint` for every buffered batch from `start`; the
    /// batches in order (waits at most `timeout_ms` for each frame).
    pub fn replay(
        &self,
        endpoint: &str,
        start: u64,
        timeout_ms: i32,
    ) -> Result<Vec<EventMessage>, EventsError> {
        let d = self.ctx.socket(zmq::DEALER)?;
        d.set_recv_timeout(timeout_ms)?;
        d.set_max_inbound_frame(MAX_FRAME)?;
        d.connect(endpoint)?;
        d.send_multipart(&[b"", &start.to_be_bytes()])?;
        let mut out = Vec::new();
        loop {
            // [empty delimiter, topic, seq, payload].
            let mut frames = d.recv_multipart(MAX_FRAME, 4)?;
            // The DEALER sees the ROUTER's empty delimiter first.
            if frames.first().is_some_and(|f| f.is_empty()) {
                frames.remove(0);
            } else {
                return Err(EventsError::BadReplay("no empty delimiter"));
            }
            let (topic, seq, payload) = split(frames)?;
            if seq == u64::from_be_bytes(END_SEQ) && topic.is_empty() && payload.is_empty() {
                return Ok(out);
            }
            out.push((topic, seq, payload));
        }
    }
}
