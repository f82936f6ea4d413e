//! An approximate radix tree of prompt text, one per model: which providers
//! recently served a prompt starting with a given prefix, and when.
//!
//! The Edge cannot see the engines' KV caches; it remembers what it sent
//! where (the approach of the SGLang router's cache-aware policy). A provider
//! that served a prompt probably still holds its prefix, so the next request
//! sharing that prefix should go there. The tree is sans-IO: it reads no
//! clock (`now` comes in) and does no IO.
//!
//! ```text
//!   root ─"You are a "─► n1 {A,B} ─"helpful bot.\n"─► n2 {A}
//!                              └──"pirate.\n"─────► n3 {B}
//! ```
//!
//! - Edges carry byte labels, split where two prompts diverge; a node's
//!   children are keyed by the first byte of their label, so a lookup or an
//!   insert does work linear in the text it considers.
//! - Every node on an inserted path is stamped with `(provider, now)`, so a
//!   node's provider set contains the sets of its children: the providers of
//!   the deepest node a text reaches are exactly those holding the longest
//!   matched prefix.
//! - Only the first [`PrefixTreeSpec::prefix_bytes_max`] bytes of a text are
//!   considered: a huge prompt costs bounded work and memory.
//! - Memory is bounded by [`PrefixTreeSpec::budget_bytes`]: after an insert,
//!   the leaf used least recently (its newest stamp) is evicted until the
//!   tree fits. The cost of a node is counted from what it holds (see
//!   [`NODE_OVERHEAD_BYTES`] and `node_cost`).
//! - [`PrefixTree::remove_provider`] drops a provider's stamps (an ejected or
//!   disconnected provider), and the nodes nobody else holds.

use std::collections::BTreeSet;
use std::mem::size_of;
use std::time::Instant;

use thiserror::Error;

/// A provider as the tree names it: Control's dense index of a provider in
/// a model's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProviderId(pub u32);

/// What a tree is configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixTreeSpec {
    /// The most bytes the tree may hold, counted as [`PrefixTree::bytes`]
    /// counts them. At least [`PrefixTree::EMPTY_BYTES`].
    pub budget_bytes: usize,
    /// How much of a text is considered: the first this many bytes.
    pub prefix_bytes_max: usize,
}

/// A spec a tree cannot be built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PrefixTreeError {
    /// The budget is below the size of an empty tree (its root).
    #[error("prefix tree budget of {budget_bytes} bytes is below the {empty_bytes} bytes of an empty tree")]
    BudgetTooSmall {
        /// The configured budget.
        budget_bytes: usize,
        /// The size of an empty tree.
        empty_bytes: usize,
    },
}

/// The answer of [`PrefixTree::longest_match`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// How many bytes of the (capped) text the tree holds as a prefix.
    pub matched_len: usize,
    /// The providers that served a prompt sharing all `matched_len` bytes,
    /// each with the last time it did, in [`ProviderId`] order. Empty when
    /// `matched_len` is 0 (nothing is known).
    pub providers: Vec<(ProviderId, Instant)>,
}

/// A stamp: `provider` served a prompt through this node, last at `at`.
type Stamp = (ProviderId, Instant);

/// An index into the node arena.
type NodeIx = u32;

const ROOT: NodeIx = 0;

/// A child reference: the first byte of its label, and its index.
type Child = (u8, NodeIx);

#[derive(Debug)]
struct Node {
    /// The edge label from the parent (empty for the root only).
    label: Box<[u8]>,
    parent: NodeIx,
    /// Sorted by first byte; at most 256.
    children: Vec<Child>,
    /// Sorted by provider; never empty except at the root.
    providers: Vec<Stamp>,
    /// The key under which this node sits in the leaf LRU index, when it is
    /// a leaf (no children, not the root).
    lru_key: Option<Instant>,
    /// What this node counts for in [`PrefixTree::bytes`].
    cost: usize,
}

/// The fixed cost of a node, whatever its label and sets hold: its arena
/// slot (`size_of::<Option<Node>>()`: the label's, children's and
/// providers' pointers and lengths, parent, LRU key, cost) plus its entry
/// in the leaf LRU index, counted as two keys' worth
/// (`2 * size_of::<(Instant, NodeIx)>()`) because the B-tree's nodes are at
/// least half full and their headers amortize to less than a key each.
/// Heap allocator headers are not counted. The arena does not shrink when
/// nodes are freed, but freed slots are reused, so its high-water mark is
/// itself bounded by the budget over this constant.
pub const NODE_OVERHEAD_BYTES: usize =
    size_of::<Option<Node>>() + 2 * size_of::<(Instant, NodeIx)>();

/// What `node` counts for: the fixed overhead plus the heap it owns (the
/// label's bytes, and the allocated capacity of its child and stamp
/// vectors).
fn node_cost(node: &Node) -> usize {
    NODE_OVERHEAD_BYTES
        + node.label.len()
        + node.children.capacity() * size_of::<Child>()
        + node.providers.capacity() * size_of::<Stamp>()
}

/// The newest stamp of a node (its last use), if it has any.
fn last_used(providers: &[Stamp]) -> Option<Instant> {
    providers.iter().map(|&(_, at)| at).max()
}

/// An approximate radix tree of prompt text (see the module docs).
#[derive(Debug)]
pub struct PrefixTree {
    spec: PrefixTreeSpec,
    nodes: Vec<Option<Node>>,
    free: Vec<NodeIx>,
    /// The leaves (not the root), by last use: the eviction order.
    lru: BTreeSet<(Instant, NodeIx)>,
    bytes: usize,
}

impl PrefixTree {
    /// The size of an empty tree: its root.
    pub const EMPTY_BYTES: usize = NODE_OVERHEAD_BYTES;

    /// An empty tree configured by `spec`.
    pub fn new(spec: PrefixTreeSpec) -> Result<Self, PrefixTreeError> {
        if spec.budget_bytes < Self::EMPTY_BYTES {
            return Err(PrefixTreeError::BudgetTooSmall {
                budget_bytes: spec.budget_bytes,
                empty_bytes: Self::EMPTY_BYTES,
            });
        }
        let mut root = Node {
            label: Box::default(),
            parent: ROOT,
            children: Vec::new(),
            providers: Vec::new(),
            lru_key: None,
            cost: 0,
        };
        root.cost = node_cost(&root);
        let bytes = root.cost;
        Ok(Self {
            spec,
            nodes: vec![Some(root)],
            free: Vec::new(),
            lru: BTreeSet::new(),
            bytes,
        })
    }

    /// The bytes the tree holds now, counted as the module docs say; at
    /// most the budget after every call.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many nodes the tree holds, its root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Records that `provider` served a prompt starting with `text` at
    /// `now`, then evicts least recently used leaves until the tree fits its
    /// budget. Work is linear in the capped text (plus the evictions).
    pub fn insert(&mut self, text: &[u8], provider: ProviderId, now: Instant) {
        let text = self.capped(text);
        let mut at = ROOT;
        let mut pos = 0;
        while pos < text.len() {
            let Some(child) = self.child(at, text[pos]) else {
                let leaf = self.alloc(Node {
                    label: text[pos..].into(),
                    parent: at,
                    children: Vec::new(),
                    providers: vec![(provider, now)],
                    lru_key: None,
                    cost: 0,
                });
                self.recost(leaf);
                self.attach(at, leaf);
                self.relink_lru(leaf);
                break;
            };
            let label = &self.node(child).label;
            let common = common_prefix_len(label, &text[pos..]);
            let next = if common < label.len() {
                self.split(child, common)
            } else {
                child
            };
            self.stamp(next, provider, now);
            pos += common;
            at = next;
        }
        self.evict_to_budget();
    }

    /// The longest prefix of `text` (capped) the tree holds, and the
    /// providers that hold it. Work is linear in the capped text.
    pub fn longest_match(&self, text: &[u8]) -> Match {
        let text = self.capped(text);
        let mut at = ROOT;
        let mut deepest = ROOT;
        let mut pos = 0;
        while pos < text.len() {
            let Some(child) = self.child(at, text[pos]) else {
                break;
            };
            let label = &self.node(child).label;
            let common = common_prefix_len(label, &text[pos..]);
            pos += common;
            deepest = child;
            if common < label.len() {
                break;
            }
            at = child;
        }
        Match {
            matched_len: pos,
            providers: self.node(deepest).providers.clone(),
        }
    }

    /// Drops every stamp of `provider`, and the nodes no other provider
    /// holds. Work is linear in the size of the tree.
    pub fn remove_provider(&mut self, provider: ProviderId) {
        self.remap_providers(|p| (p != provider).then_some(p));
    }

    /// Renames every provider through `map` (a reload renumbers them), and
    /// drops the stamps of those it maps to `None`, with the nodes no other
    /// provider holds. `map` must be one-to-one on what it keeps. Work is
    /// linear in the size of the tree.
    pub fn remap_providers(&mut self, map: impl Fn(ProviderId) -> Option<ProviderId>) {
        let mut stack = vec![ROOT];
        while let Some(at) = stack.pop() {
            let children = self.node(at).children.clone();
            let mut kept = Vec::with_capacity(children.len());
            for (first, child) in children {
                let node = self.node_mut(child);
                let mut providers: Vec<Stamp> = node
                    .providers
                    .iter()
                    .filter_map(|&(p, when)| map(p).map(|q| (q, when)))
                    .collect();
                providers.sort_unstable_by_key(|&(p, _)| p);
                providers.shrink_to_fit();
                node.providers = providers;
                self.recost(child);
                self.relink_lru(child);
                if self.node(child).providers.is_empty() {
                    self.free_subtree(child);
                } else {
                    kept.push((first, child));
                    stack.push(child);
                }
            }
            let node = self.node_mut(at);
            if kept.len() != node.children.len() {
                kept.shrink_to_fit();
                node.children = kept;
                self.recost(at);
                self.relink_lru(at);
            }
        }
    }

    fn capped<'t>(&self, text: &'t [u8]) -> &'t [u8] {
        &text[..text.len().min(self.spec.prefix_bytes_max)]
    }

    fn node(&self, ix: NodeIx) -> &Node {
        self.nodes[ix as usize]
            .as_ref()
            .expect("a linked node index names a live node")
    }

    fn node_mut(&mut self, ix: NodeIx) -> &mut Node {
        self.nodes[ix as usize]
            .as_mut()
            .expect("a linked node index names a live node")
    }

    fn child(&self, at: NodeIx, first: u8) -> Option<NodeIx> {
        let children = &self.node(at).children;
        children
            .binary_search_by_key(&first, |&(byte, _)| byte)
            .ok()
            .map(|i| children[i].1)
    }

    fn alloc(&mut self, node: Node) -> NodeIx {
        match self.free.pop() {
            Some(ix) => {
                self.nodes[ix as usize] = Some(node);
                ix
            }
            None => {
                let ix = NodeIx::try_from(self.nodes.len())
                    .expect("the budget keeps the node count far below u32::MAX");
                self.nodes.push(Some(node));
                ix
            }
        }
    }

    /// Recounts `ix`'s cost into the total after a change to it.
    fn recost(&mut self, ix: NodeIx) {
        let node = self.node_mut(ix);
        let old = node.cost;
        node.cost = node_cost(node);
        let new = node.cost;
        self.bytes = self.bytes - old + new;
    }

    /// Puts `ix` in the LRU index under its current last use if it is a
    /// leaf, and takes it out if it is not.
    fn relink_lru(&mut self, ix: NodeIx) {
        let node = self.node(ix);
        let want = if ix != ROOT && node.children.is_empty() {
            last_used(&node.providers)
        } else {
            None
        };
        let had = node.lru_key;
        if had == want {
            return;
        }
        if let Some(at) = had {
            self.lru.remove(&(at, ix));
        }
        if let Some(at) = want {
            self.lru.insert((at, ix));
        }
        self.node_mut(ix).lru_key = want;
    }

    /// Adds `child` to `parent`'s children (its first byte is not there).
    fn attach(&mut self, parent: NodeIx, child: NodeIx) {
        let first = self.node(child).label[0];
        let children = &mut self.node_mut(parent).children;
        let i = children
            .binary_search_by_key(&first, |&(byte, _)| byte)
            .expect_err("a new child's first byte is not among its siblings'");
        children.insert(i, (first, child));
        self.recost(parent);
        self.relink_lru(parent);
    }

    /// Splits `child`'s edge after `at` bytes (`0 < at < label.len()`):
    /// a new node takes the first `at` bytes and `child`'s stamps, and
    /// `child` hangs below it. Returns the new node.
    fn split(&mut self, child: NodeIx, at: usize) -> NodeIx {
        let node = self.node(child);
        let parent = node.parent;
        let head: Box<[u8]> = node.label[..at].into();
        let tail: Box<[u8]> = node.label[at..].into();
        let providers = node.providers.clone();
        let mid = self.alloc(Node {
            label: head,
            parent,
            children: vec![(tail[0], child)],
            providers,
            lru_key: None,
            cost: 0,
        });
        self.recost(mid);
        let node = self.node_mut(child);
        node.label = tail;
        node.parent = mid;
        self.recost(child);
        let first = self.node(mid).label[0];
        let siblings = &mut self.node_mut(parent).children;
        let i = siblings
            .binary_search_by_key(&first, |&(byte, _)| byte)
            .expect("a split child is among its parent's children");
        siblings[i].1 = mid;
        mid
    }

    /// Records `provider` at `now` on `ix` (never moving a stamp back).
    fn stamp(&mut self, ix: NodeIx, provider: ProviderId, now: Instant) {
        let providers = &mut self.node_mut(ix).providers;
        match providers.binary_search_by_key(&provider, |&(p, _)| p) {
            Ok(i) => providers[i].1 = providers[i].1.max(now),
            Err(i) => providers.insert(i, (provider, now)),
        }
        self.recost(ix);
        self.relink_lru(ix);
    }

    /// Frees `ix` and everything below it (the caller unlinks `ix` from its
    /// parent).
    fn free_subtree(&mut self, ix: NodeIx) {
        let mut stack = vec![ix];
        while let Some(at) = stack.pop() {
            let node = self.nodes[at as usize]
                .take()
                .expect("a linked node index names a live node");
            if let Some(key) = node.lru_key {
                self.lru.remove(&(key, at));
            }
            self.bytes -= node.cost;
            self.free.push(at);
            stack.extend(node.children.iter().map(|&(_, child)| child));
        }
    }

    fn evict_to_budget(&mut self) {
        while self.bytes > self.spec.budget_bytes {
            let Some((_, leaf)) = self.lru.pop_first() else {
                break;
            };
            self.node_mut(leaf).lru_key = None;
            let parent = self.node(leaf).parent;
            let first = self.node(leaf).label[0];
            let siblings = &mut self.node_mut(parent).children;
            let i = siblings
                .binary_search_by_key(&first, |&(byte, _)| byte)
                .expect("a leaf is among its parent's children");
            siblings.remove(i);
            if siblings.is_empty() {
                // An empty root must cost exactly `EMPTY_BYTES`.
                siblings.shrink_to_fit();
            }
            self.free_subtree(leaf);
            self.recost(parent);
            self.relink_lru(parent);
        }
    }
}

fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests;
