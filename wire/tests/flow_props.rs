//! Properties of per-run flow control: a Node's [`SendWindow`], the Edge's
//! [`RecvWindow`] and [`DrainWindow`], with a link in between that delivers
//! frames in order and credits late, reordered and duplicated. Under any
//! interleaving the Edge never sees an overrun and never buffers more than
//! a window; once the scheduler is fair, every payload byte reaches the
//! client (no deadlock while the client drains), whatever the frame sizes,
//! as long as the sender splits what does not fit and sends whole only
//! frames charged at most half a window (the rule in `iop_wire::flow`).

use std::collections::VecDeque;

use iop_wire::flow::{DrainWindow, RecvWindow, SendWindow, FRAME_CHARGE_BYTES, MIN_WINDOW_BYTES};
use proptest::prelude::*;

/// A frame the Node wants to send: payload bytes (0 = a usage frame).
#[derive(Debug, Clone, Copy)]
struct Pending {
    payload: u64,
    splittable: bool,
}

impl Pending {
    fn charge(&self) -> u64 {
        self.payload + FRAME_CHARGE_BYTES
    }
}

#[derive(Debug)]
struct Model {
    window: u64,
    node: SendWindow,
    to_send: VecDeque<Pending>,
    /// Frames on the wire Node → Edge (in order), by charge and payload.
    uplink: VecDeque<(u64, u64)>,
    edge_recv: RecvWindow,
    /// The run's buffer at the Edge, by charge and payload.
    buffer: VecDeque<(u64, u64)>,
    drain: DrainWindow,
    /// Credits on the way Edge → Node (any order, may repeat).
    downlink: Vec<u64>,
    payload_total: u64,
    payload_delivered: u64,
}

#[derive(Debug, Clone, Copy)]
enum Step {
    NodeSend,
    Deliver,
    ClientDrain,
    Credit { pick: usize, duplicate: bool },
}

impl Model {
    fn new(window: u64, frames: Vec<Pending>) -> Self {
        let payload_total = frames.iter().map(|f| f.payload).sum();
        Self {
            window,
            node: SendWindow::new(window),
            to_send: frames.into(),
            uplink: VecDeque::new(),
            edge_recv: RecvWindow::new(window),
            buffer: VecDeque::new(),
            drain: DrainWindow::new(window),
            downlink: Vec::new(),
            payload_total,
            payload_delivered: 0,
        }
    }

    /// What the Node shell does with its next output: send it whole when it
    /// fits, send the part that fits when it can be split, else wait.
    fn node_send(&mut self) -> bool {
        let Some(front) = self.to_send.front_mut() else {
            return false;
        };
        if self.node.fits(front.charge()) {
            let sent = *front;
            self.to_send.pop_front();
            self.node.consume(sent.charge());
            self.uplink.push_back((sent.charge(), sent.payload));
            return true;
        }
        let allowance = self.node.payload_allowance();
        if front.splittable && allowance > 0 {
            let head = allowance.min(front.payload);
            front.payload -= head;
            let charge = head + FRAME_CHARGE_BYTES;
            assert!(self.node.fits(charge));
            self.node.consume(charge);
            self.uplink.push_back((charge, head));
            return true;
        }
        false
    }

    fn deliver(&mut self) -> bool {
        let Some((charge, payload)) = self.uplink.pop_front() else {
            return false;
        };
        self.edge_recv
            .on_received(charge)
            .unwrap_or_else(|e| panic!("the Edge saw an overrun: {e}"));
        self.buffer.push_back((charge, payload));
        let buffered: u64 = self.buffer.iter().map(|(c, _)| c).sum();
        assert!(
            buffered <= self.window,
            "buffered {buffered} > window {}",
            self.window
        );
        true
    }

    fn client_drain(&mut self) -> bool {
        let Some((charge, payload)) = self.buffer.pop_front() else {
            return false;
        };
        self.payload_delivered += payload;
        if let Some(credit) = self.drain.on_consumed(charge) {
            self.edge_recv.on_credit_sent(credit);
            self.downlink.push(credit);
        }
        true
    }

    fn credit(&mut self, pick: usize, duplicate: bool) -> bool {
        if self.downlink.is_empty() {
            return false;
        }
        let index = pick % self.downlink.len();
        let credit = if duplicate {
            self.downlink[index]
        } else {
            self.downlink.swap_remove(index)
        };
        self.node.on_credit(credit);
        true
    }

    fn apply(&mut self, step: Step) -> bool {
        match step {
            Step::NodeSend => self.node_send(),
            Step::Deliver => self.deliver(),
            Step::ClientDrain => self.client_drain(),
            Step::Credit { pick, duplicate } => self.credit(pick, duplicate),
        }
    }

    fn done(&self) -> bool {
        self.to_send.is_empty() && self.uplink.is_empty() && self.buffer.is_empty()
    }
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::NodeSend),
        3 => Just(Step::Deliver),
        2 => Just(Step::ClientDrain),
        2 => (any::<usize>(), any::<bool>())
            .prop_map(|(pick, duplicate)| Step::Credit { pick, duplicate }),
    ]
}

fn frames(window: u64) -> impl Strategy<Value = Vec<Pending>> {
    prop::collection::vec(
        prop_oneof![
            // Token-sized, body-sized, larger than the window, usage frames.
            (1u64..300).prop_map(|payload| Pending {
                payload,
                splittable: true
            }),
            (1u64..=window).prop_map(|payload| Pending {
                payload,
                splittable: true
            }),
            (window..window * 3).prop_map(|payload| Pending {
                payload,
                splittable: true
            }),
            Just(Pending {
                payload: 0,
                splittable: false
            }),
            // A unit that cannot be split (the last character of a delta):
            // at most half a window, the sender's rule.
            (1u64..=(window / 2 - FRAME_CHARGE_BYTES)).prop_map(|payload| Pending {
                payload,
                splittable: false
            }),
        ],
        0..60,
    )
}

fn case() -> impl Strategy<Value = (u64, Vec<Pending>, Vec<Step>)> {
    (MIN_WINDOW_BYTES..64 * 1024).prop_flat_map(|window| {
        (
            Just(window),
            frames(window),
            prop::collection::vec(step(), 0..400),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn no_overrun_no_unbounded_buffer_no_deadlock((window, frames, steps) in case()) {
        let mut model = Model::new(window, frames);
        // Adversarial phase: whatever the scheduler picks.
        for step in steps {
            model.apply(step);
        }
        // Fair phase: every party gets its turn until nothing moves.
        let mut rounds = 0u32;
        loop {
            let moved = model.node_send()
                | model.deliver()
                | model.client_drain()
                | model.credit(0, false);
            if !moved {
                break;
            }
            rounds += 1;
            prop_assert!(rounds < 1_000_000, "no progress bound");
        }
        prop_assert!(model.done(), "deadlock: {model:?}");
        prop_assert_eq!(model.payload_delivered, model.payload_total);
        prop_assert!(model.node.sent() <= model.edge_recv.granted());
    }
}
