//! The session store: up to `capacity` token streams, each with the KV cache that holds
//! it, evicted least recently used first. A request checks out the stream whose cache
//! can give back the longest prefix of its prompt (cut to that prefix: anywhere for keys
//! and values, at a kept state snapshot for DeltaNet states), or a fresh or recycled
//! cache when nothing matches, and checks it back in when done.

use crate::contract::KvState;

/// One stored stream: `tokens[i]` is the token at cache position `i`.
struct Session<C> {
    tokens: Vec<u32>,
    cache: C,
    last_used: u64,
}

/// A cache checked out for one request.
pub struct Checkout<C> {
    /// The cache, holding exactly the first `cached` positions of the prompt.
    pub cache: C,
    /// Prompt tokens already in the cache (not to be prefilled again).
    pub cached: usize,
}

/// Stored streams, at most `capacity` caches in all (stored plus checked out).
pub struct SessionStore<C> {
    sessions: Vec<Session<C>>,
    capacity: usize,
    clock: u64,
}

impl<C: KvState> SessionStore<C> {
    /// An empty store for up to `capacity` caches (at least one).
    pub fn new(capacity: usize) -> Self {
        SessionStore { sessions: Vec::new(), capacity: capacity.max(1), clock: 0 }
    }

    /// Streams stored now.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no stream is stored.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Takes the cache for `prompt`: the stored stream with the longest common prefix
    /// (capped at `prompt.len() - 1`, so at least one token is left to run), truncated
    /// to it; otherwise a new cache from `make` while under capacity, else the least
    /// recently used cache emptied.
    pub fn checkout<E>(
        &mut self,
        prompt: &[u32],
        make: impl FnOnce() -> Result<C, E>,
    ) -> Result<Checkout<C>, E> {
        let cap = prompt.len().saturating_sub(1);
        let best = self
            .sessions
            .iter()
            .enumerate()
            .map(|(i, s)| (s.cache.reusable(common_prefix(&s.tokens, prompt).min(cap)), s.last_used, i))
            .max();
        if let Some((cached, _, i)) = best.filter(|b| b.0 > 0) {
            let mut s = self.sessions.swap_remove(i);
            let cached = s.cache.truncate(cached);
            return Ok(Checkout { cache: s.cache, cached });
        }
        if self.sessions.len() < self.capacity {
            return Ok(Checkout { cache: make()?, cached: 0 });
        }
        let lru =
            (0..self.sessions.len()).min_by_key(|&i| self.sessions[i].last_used).expect("store is full");
        let mut s = self.sessions.swap_remove(lru);
        s.cache.truncate(0);
        Ok(Checkout { cache: s.cache, cached: 0 })
    }

    /// Stores `cache` holding `tokens` (cut to the positions the cache holds) as the
    /// most recently used stream; an empty stream is stored as the first to recycle.
    pub fn checkin(&mut self, mut tokens: Vec<u32>, cache: C) {
        tokens.truncate(cache.len());
        self.clock += 1;
        let last_used = if tokens.is_empty() { 0 } else { self.clock };
        self.sessions.push(Session { tokens, cache, last_used });
        while self.sessions.len() > self.capacity {
            let lru =
                (0..self.sessions.len()).min_by_key(|&i| self.sessions[i].last_used).expect("non-empty");
            self.sessions.swap_remove(lru);
        }
    }
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in cache that counts positions and remembers its identity.
    struct Fake {
        id: u32,
        len: usize,
    }

    impl KvState for Fake {
        fn len(&self) -> usize {
            self.len
        }
        fn truncate(&mut self, len: usize) -> usize {
            self.len = self.len.min(len);
            self.len
        }
        fn advance(&mut self, n: usize) {
            self.len += n;
        }
    }

    fn run(
        store: &mut SessionStore<Fake>,
        prompt: &[u32],
        generated: &[u32],
        next_id: &mut u32,
    ) -> (u32, usize) {
        let c = store
            .checkout(prompt, || {
                *next_id += 1;
                Ok::<_, ()>(Fake { id: *next_id, len: 0 })
            })
            .expect("infallible");
        let (id, cached) = (c.cache.id, c.cached);
        let mut cache = c.cache;
        // The engine fills the prompt and all generated tokens but the last.
        cache.len = prompt.len() + generated.len().saturating_sub(1);
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(generated);
        store.checkin(tokens, cache);
        (id, cached)
    }

    #[test]
    fn second_turn_reuses_the_first() {
        let mut s = SessionStore::new(2);
        let mut n = 0;
        assert_eq!(run(&mut s, &[1, 2, 3], &[4, 5], &mut n), (1, 0));
        // Turn 2 extends turn 1 (prompt, reply, new user text): the cache holds 1,2,3,4.
        assert_eq!(run(&mut s, &[1, 2, 3, 4, 5, 6], &[7], &mut n), (1, 4));
        // The same prompt again: all but its last token are reused.
        assert_eq!(run(&mut s, &[1, 2, 3, 4, 5, 6], &[7], &mut n), (1, 5));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn unrelated_prompts_get_new_caches_then_recycle_the_least_recent() {
        let mut s = SessionStore::new(2);
        let mut n = 0;
        assert_eq!(run(&mut s, &[1, 2], &[3], &mut n).0, 1);
        assert_eq!(run(&mut s, &[9, 8], &[7], &mut n).0, 2);
        assert_eq!(s.len(), 2);
        // Full: a third stream recycles cache 1 (least recently used).
        assert_eq!(run(&mut s, &[5, 5], &[5], &mut n), (1, 0));
        // Stream 9,8 is still there.
        assert_eq!(run(&mut s, &[9, 8, 7, 1], &[], &mut n), (2, 2));
        assert_eq!(n, 2, "never more caches than the capacity");
    }

    #[test]
    fn reuse_never_covers_the_whole_prompt() {
        let mut s = SessionStore::new(1);
        let mut n = 0;
        run(&mut s, &[1, 2, 3, 4], &[5, 6], &mut n);
        assert_eq!(run(&mut s, &[1, 2], &[], &mut n), (1, 1));
        assert_eq!(run(&mut s, &[7], &[], &mut n), (1, 0));
    }
}
