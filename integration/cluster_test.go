package integration

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/Azure/go-amqp"

	"github.com/amqpsub/amqpsub/amqpsub"
	"github.com/amqpsub/amqpsub/internal/publish"
)

// The tests of this file and ha_test.go run against the multi-broker
// topologies of integration/artemis-cluster.sh: a two-node cluster
// (`cluster`) and a shared-store primary/backup pair (`ha`). Each test
// starts its topology from empty journals and stops it (deleting its data)
// when it ends; if the test binary dies first, a watchdog process does.
// They skip without AMQPSUB_CLUSTER_CTL. What they found is in
// docs/brokers.md, "Clusters, message groups and HA".

// handling is one handler call of a clusterRecorder.
type handling struct {
	sub   int // which subscriber (0: node 1, 1: node 2)
	group string
	src   int // the node the message was sent to (1, 2), 0 for none
	seq   int
	count uint32 // delivery-count
}

// clusterRecorder records what the subscribers of a cluster test handle.
type clusterRecorder struct {
	mu     sync.Mutex
	list   []handling
	probes [2]int
}

// clusterMsg is a message of group g (none if ""), sent to node src, with
// seq counted per group and node.
func clusterMsg(g string, src, seq int) *amqp.Message {
	m := message(msgSpec{group: g, seq: seq})
	m.ApplicationProperties["src"] = int64(src)
	return m
}

func (r *clusterRecorder) handler(sub int) amqpsub.Handler {
	return amqpsub.HandlerFunc(func(ctx context.Context, d *amqpsub.Delivery) error {
		ap := d.ApplicationProperties()
		r.mu.Lock()
		defer r.mu.Unlock()
		if _, ok := ap["probe"]; ok {
			r.probes[sub]++
			return nil
		}
		src, _ := ap["src"].(int64)
		r.list = append(r.list, handling{sub: sub, group: d.GroupID(), src: int(src), seq: seqOf(d), count: d.DeliveryCount()})
		return nil
	})
}

func (r *clusterRecorder) handled() []handling {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.list)
}

// count returns how many handlings match f.
func (r *clusterRecorder) count(f func(h handling) bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, h := range r.list {
		if f(h) {
			n++
		}
	}
	return n
}

func (r *clusterRecorder) probed(sub int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.probes[sub] > 0
}

// startClusterSubs runs one amqpsub subscriber (WorkersByKey) on queue q of
// each node, and returns once each node routes to the other's consumer:
// a probe sent to node 1 has reached the subscriber of node 2 and one sent
// to node 2 the subscriber of node 1 (ON_DEMAND load balancing forwards a
// message only to a node whose queue has a consumer). It returns a function
// per subscriber that stops it and waits for its Run.
func startClusterSubs(t *testing.T, r *clusterRecorder, q string, urls [2]string) (stop [2]func()) {
	t.Helper()
	for i, u := range urls {
		stop[i] = runClusterSub(t, r, q, u, i)
	}
	for from, to := range []int{1, 0} {
		conn := dial(t, urls[from])
		snd := rawSender(t, conn, q, "queue")
		t0 := time.Now()
		waitFor(t, 60*time.Second, fmt.Sprintf("node %d to route to the consumer on node %d", from+1, to+1), func() bool {
			m := amqp.NewMessage([]byte("probe"))
			m.ApplicationProperties = map[string]any{"probe": true}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := snd.Send(ctx, m, nil); err != nil {
				t.Fatalf("probe: %v", err)
			}
			time.Sleep(50 * time.Millisecond) // a probe every 50 ms until one arrives
			return r.probed(to)
		})
		t.Logf("node %d routes to node %d's consumer after %v", from+1, to+1, time.Since(t0).Round(time.Millisecond))
	}
	return stop
}

// runClusterSub runs a subscriber on queue q of the node at url, recording
// as subscriber sub, and returns a function that stops it gracefully.
func runClusterSub(t *testing.T, r *clusterRecorder, q, url string, sub int) func() {
	t.Helper()
	s, err := amqpsub.New(amqpsub.Dial(url, nil), q, r.handler(sub),
		amqpsub.WorkersByKey(4), amqpsub.Backoff(100*time.Millisecond, time.Second),
		amqpsub.Logger(logger(t)))
	if err != nil {
		t.Fatal(err)
	}
	stop, wait := runSub(t, s)
	return func() {
		stop()
		if err := wait(); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("subscriber %d: %v", sub, err)
		}
	}
}

// sendAll sends msgs to q over one link, all pre-settled but the last.
func sendAll(ctx context.Context, conn *amqp.Conn, q string, msgs []*amqp.Message) error {
	return publish.Send(ctx, conn, publish.Target{Address: q, Capabilities: []string{"queue"}}, 1, len(msgs),
		func(i int) *amqp.Message { return msgs[i] })
}

// groupOwners maps each group to the subscribers that handled it.
func groupOwners(hs []handling) map[string][]int {
	owners := map[string][]int{}
	for _, h := range hs {
		if h.group != "" && !slices.Contains(owners[h.group], h.sub) {
			owners[h.group] = append(owners[h.group], h.sub)
		}
	}
	return owners
}

// streamViolations counts, per group and sending node, the handlings whose
// seq is not the previous one's + 1 (from 0), and the duplicates. Ungrouped
// messages are left out: WorkersByKey spreads them over its lanes.
func streamViolations(hs []handling) (violations, dups int) {
	type key struct {
		group string
		src   int
	}
	next := map[key]int{}
	seen := map[key]map[int]bool{}
	for _, h := range hs {
		if h.group == "" {
			continue
		}
		k := key{h.group, h.src}
		if seen[k] == nil {
			seen[k] = map[int]bool{}
		}
		if seen[k][h.seq] {
			dups++
		}
		seen[k][h.seq] = true
		if h.seq != next[k] {
			violations++
		}
		next[k] = h.seq + 1
	}
	return violations, dups
}

// TestArtemisCluster checks, on a two-node cluster with static connectors,
// ON_DEMAND load balancing, redistribution-delay 0 and a clustered grouping
// handler (LOCAL on node 1, REMOTE on node 2): redistribution, message
// groups across the nodes, groups whose node has no consumer, and what a
// group does when the node that holds it, or the LOCAL handler's node, is
// killed. The subtests that kill a node come last.
func TestArtemisCluster(t *testing.T) {
	tp := startTopology(t, "cluster")
	urls := [2]string{tp.url(t, "1"), tp.url(t, "2")}

	// Messages sent to node 1, where nobody consumes, reach a consumer that
	// attaches on node 2 later: node 1 redistributes them.
	t.Run("redistribution", func(t *testing.T) {
		const n = 500
		q := queueName(t)
		publishFast(t, dial(t, urls[0]), q, true, uniqueSeqs(n, 0))
		t0 := time.Now()
		r := rawReceiver(t, dial(t, urls[1]), q, 100)
		var first time.Duration
		got := make([]int, 0, n+1)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		for len(got) < n+1 {
			m, err := r.Receive(ctx, nil)
			if err != nil {
				t.Fatalf("received %d of %d on node 2: %v", len(got), n+1, err)
			}
			if len(got) == 0 {
				first = time.Since(t0)
			}
			if err := r.AcceptMessage(ctx, m); err != nil {
				t.Fatal(err)
			}
			v, _ := m.ApplicationProperties["seq"].(int64)
			got = append(got, int(v))
		}
		all := time.Since(t0)
		// publishFast's barrier (seq -1) was sent last.
		want := make([]int, 0, n+1)
		for i := range n {
			want = append(want, i)
		}
		want = append(want, -1)
		if !slices.Equal(got, want) {
			sorted := slices.Clone(got)
			sort.Ints(sorted)
			wantSorted := slices.Clone(want)
			sort.Ints(wantSorted)
			if !slices.Equal(sorted, wantSorted) {
				t.Fatalf("node 2 got a different set of messages than node 1 was sent")
			}
			t.Errorf("node 2 got every message, but not in the order node 1 was sent them")
		}
		t.Logf("%d messages sent to node 1 reached a consumer on node 2, in order: first after %v, all after %v",
			n+1, first.Round(time.Millisecond), all.Round(time.Millisecond))
	})

	// Grouped messages sent to both nodes, a subscriber on each: every group
	// is handled by exactly one of them, and each node's messages of a group
	// in the order that node was sent them.
	t.Run("groups stick to one consumer cluster-wide", func(t *testing.T) {
		const groupsN, per = 40, 25 // per group and node
		q := queueName(t)
		r := &clusterRecorder{}
		startClusterSubs(t, r, q, urls)
		var msgs [2][]*amqp.Message
		for s := range per {
			for g := range groupsN {
				for node := range 2 {
					msgs[node] = append(msgs[node], clusterMsg(fmt.Sprintf("g%03d", g), node+1, s))
				}
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		t0 := time.Now()
		conns := [2]*amqp.Conn{dial(t, urls[0]), dial(t, urls[1])}
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for node := range 2 {
			wg.Go(func() { errs[node] = sendAll(ctx, conns[node], q, msgs[node]) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		sent := time.Since(t0)
		total := 2 * groupsN * per
		waitFor(t, 2*time.Minute, "every grouped message handled", func() bool { return r.count(func(handling) bool { return true }) >= total })
		hs := r.handled()
		owners := groupOwners(hs)
		var on [2]int
		for g, subs := range owners {
			if len(subs) != 1 {
				t.Errorf("group %s handled by the subscribers of nodes %v", g, subs)
				continue
			}
			on[subs[0]]++
		}
		v, d := streamViolations(hs)
		if v != 0 || d != 0 || len(hs) != total {
			t.Errorf("%d handlings of %d messages, %d order violations, %d duplicates", len(hs), total, v, d)
		}
		if on[0] == 0 || on[1] == 0 {
			t.Errorf("groups by node %v: want some on each node", on)
		}
		t.Logf("%d messages in %d groups sent to both nodes in %v, handled in %v: groups on node 1 %d, node 2 %d; "+
			"every group on one subscriber, 0 order violations per group and sending node",
			total, groupsN, sent.Round(time.Millisecond), time.Since(t0).Round(time.Millisecond), on[0], on[1])
	})

	// A group stays on the node its queue is on, consumer or not: when node
	// 2's subscriber stops, node 2 keeps its groups' new messages (also
	// those sent to node 1) and redistribution, which moves ungrouped
	// messages at once, leaves them there until a consumer attaches to
	// node 2 again.
	t.Run("grouped messages are not redistributed", func(t *testing.T) {
		const groupsN, per = 20, 3
		q := queueName(t)
		r := &clusterRecorder{}
		stops := startClusterSubs(t, r, q, urls)
		conns := [2]*amqp.Conn{dial(t, urls[0]), dial(t, urls[1])}
		batch := func(node, from int) []*amqp.Message {
			var ms []*amqp.Message
			for s := from; s < from+per; s++ {
				for g := range groupsN {
					ms = append(ms, clusterMsg(fmt.Sprintf("g%03d", g), node, s))
				}
			}
			return ms
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := sendAll(ctx, conns[0], q, batch(1, 0)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "the first batch handled", func() bool { return r.count(func(handling) bool { return true }) >= groupsN*per })
		var onNode2 []string
		for g, subs := range groupOwners(r.handled()) {
			if slices.Equal(subs, []int{1}) {
				onNode2 = append(onNode2, g)
			}
		}
		if len(onNode2) == 0 || len(onNode2) == groupsN {
			t.Fatalf("node 2's subscriber holds %d of %d groups; the test needs some on each node", len(onNode2), groupsN)
		}
		isNode2 := func(h handling) bool { return slices.Contains(onNode2, h.group) }
		stops[1]()

		// The second batch through node 1 and the third through node 2,
		// and ungrouped messages through node 2 (seq counted under "").
		if err := sendAll(ctx, conns[0], q, batch(1, per)); err != nil {
			t.Fatal(err)
		}
		if err := sendAll(ctx, conns[1], q, batch(2, 0)); err != nil {
			t.Fatal(err)
		}
		var plain []*amqp.Message
		for i := range 20 {
			plain = append(plain, clusterMsg("", 2, i))
		}
		if err := sendAll(ctx, conns[1], q, plain); err != nil {
			t.Fatal(err)
		}
		node1Groups := groupsN - len(onNode2)
		waitFor(t, time.Minute, "node 1's groups and the ungrouped messages handled", func() bool {
			return r.count(func(h handling) bool { return h.group != "" && !isNode2(h) && (h.src == 2 || h.seq >= per) }) >= 2*node1Groups*per &&
				r.count(func(h handling) bool { return h.group == "" }) >= len(plain)
		})
		if n := r.count(func(h handling) bool { return isNode2(h) && (h.src == 2 || h.seq >= per) }); n != 0 {
			t.Fatalf("%d messages of node 2's groups handled while node 2 had no consumer", n)
		}
		kept := queueAttribute(t, conns[1], q, "messageCount")
		if kept != fmt.Sprint(2*len(onNode2)*per) {
			t.Errorf("node 2's queue holds %s messages, want %d (its groups' new messages)", kept, 2*len(onNode2)*per)
		}

		t0 := time.Now()
		stops[1] = runClusterSub(t, r, q, urls[1], 1)
		waitFor(t, time.Minute, "node 2's groups handled by a new subscriber on node 2", func() bool {
			return r.count(func(h handling) bool { return isNode2(h) && (h.src == 2 || h.seq >= per) }) >= 2*len(onNode2)*per
		})
		hs := r.handled()
		for g, subs := range groupOwners(hs) {
			if len(subs) != 1 {
				t.Errorf("group %s handled by the subscribers of nodes %v", g, subs)
			}
		}
		if v, d := streamViolations(hs); v != 0 || d != 0 {
			t.Errorf("%d order violations, %d duplicates", v, d)
		}
		t.Logf("node 2's subscriber stopped: the %d new messages of its %d groups (sent to either node) stayed in node 2's queue "+
			"while node 1's subscriber handled its %d groups and %d ungrouped messages sent to node 2; "+
			"a new subscriber on node 2 had them all, in order, %v after it started",
			2*len(onNode2)*per, len(onNode2), node1Groups, len(plain), time.Since(t0).Round(time.Millisecond))
	})

	// Node 2 dies while it holds groups. The LOCAL handler (node 1) keeps
	// them bound to node 2's queue, so node 1 keeps their new messages in
	// its store-and-forward queue for node 2, and its own subscriber never
	// gets them; when node 2 is back, its subscriber (reconnected by
	// amqpsub) gets them, in order.
	t.Run("node holding a group killed", func(t *testing.T) {
		const groupsN, per = 20, 5
		q := queueName(t)
		r := &clusterRecorder{}
		startClusterSubs(t, r, q, urls)
		c1 := dial(t, urls[0])
		node2ID := resourceAttribute(t, dial(t, urls[1]), "broker", "NodeID")
		batch := func(from int) []*amqp.Message {
			var ms []*amqp.Message
			for s := from; s < from+per; s++ {
				for g := range groupsN {
					ms = append(ms, clusterMsg(fmt.Sprintf("g%03d", g), 1, s))
				}
			}
			return ms
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := sendAll(ctx, c1, q, batch(0)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "the first batch handled", func() bool { return r.count(func(handling) bool { return true }) >= groupsN*per })
		owners := groupOwners(r.handled())
		var onNode2 []string
		for g, subs := range owners {
			if slices.Equal(subs, []int{1}) {
				onNode2 = append(onNode2, g)
			}
		}
		if len(onNode2) == 0 || len(onNode2) == groupsN {
			t.Fatalf("node 2's subscriber holds %d of %d groups; the test needs some on each node", len(onNode2), groupsN)
		}
		isNode2 := func(h handling) bool { return slices.Contains(onNode2, h.group) }

		t.Cleanup(func() { tp.run("start-node", "2") })
		kill := tp.timed(t, "kill9", "2")
		if err := sendAll(ctx, c1, q, batch(per)); err != nil {
			t.Fatal(err)
		}
		node1Groups := groupsN - len(onNode2)
		waitFor(t, time.Minute, "node 1's groups' second batch handled", func() bool {
			return r.count(func(h handling) bool { return !isNode2(h) && h.seq >= per }) >= node1Groups*per
		})
		// Node 2's groups: parked in node 1's store-and-forward queue.
		sf := "$.artemis.internal.sf.amqpsub-cluster." + node2ID
		parked := queueAttribute(t, c1, sf, "messageCount")
		if n := r.count(func(h handling) bool { return isNode2(h) && h.seq >= per }); n != 0 {
			t.Fatalf("%d messages of node 2's groups handled while node 2 was down", n)
		}
		if parked != fmt.Sprint(len(onNode2)*per) {
			t.Errorf("node 1's store-and-forward queue for node 2 holds %s messages, want %d (node 2's groups' second batch)", parked, len(onNode2)*per)
		}

		restart := tp.timed(t, "start-node", "2")
		t0 := time.Now()
		waitFor(t, 2*time.Minute, "node 2's groups' second batch handled", func() bool {
			return r.count(func(h handling) bool { return isNode2(h) && h.seq >= per }) >= len(onNode2)*per
		})
		resumed := time.Since(t0)
		hs := r.handled()
		for g, subs := range groupOwners(hs) {
			if len(subs) != 1 {
				t.Errorf("group %s handled by the subscribers of nodes %v", g, subs)
			}
		}
		if v, d := streamViolations(hs); v != 0 || d != 0 {
			t.Errorf("%d order violations, %d duplicates", v, d)
		}
		t.Logf("kill -9 of node 2 (holding %d of %d groups) took %v; node 1 kept handling its %d groups; "+
			"node 2's groups' %s new messages waited in node 1's store-and-forward queue; node 2 restarted in %v "+
			"and its subscriber had them all, in order, %v after that",
			len(onNode2), groupsN, kill.Round(time.Millisecond), node1Groups, parked,
			restart.Round(time.Millisecond), resumed.Round(time.Millisecond))
	})

	// Node 1, the LOCAL grouping handler, dies. Node 2 keeps routing the
	// groups it has a decision for (cached) at once; a new group waits for
	// a decision that cannot come: Artemis asks 11 times, each bounded by
	// the handler's timeout (1 s in our broker.xml), then routes the
	// message without grouping.
	t.Run("LOCAL grouping handler node killed", func(t *testing.T) {
		const groupsN, per = 20, 3
		q := queueName(t)
		r := &clusterRecorder{}
		startClusterSubs(t, r, q, urls)
		c2 := dial(t, urls[1])
		var ms []*amqp.Message
		for s := range per {
			for g := range groupsN {
				ms = append(ms, clusterMsg(fmt.Sprintf("g%03d", g), 2, s))
			}
		}
		if err := sendAll(context.Background(), c2, q, ms); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "the first batch handled", func() bool { return r.count(func(handling) bool { return true }) >= groupsN*per })
		owners := groupOwners(r.handled())
		var g1, g2 string // a group on node 1's subscriber, one on node 2's
		for g, subs := range owners {
			switch {
			case slices.Equal(subs, []int{0}) && (g1 == "" || g < g1):
				g1 = g
			case slices.Equal(subs, []int{1}) && (g2 == "" || g < g2):
				g2 = g
			}
		}
		if g1 == "" || g2 == "" {
			t.Fatalf("groups by subscriber %v: the test needs one on each node", owners)
		}

		t.Cleanup(func() { tp.run("start-node", "1") })
		tp.do(t, "kill9", "1")
		snd := rawSender(t, c2, q, "queue")
		send := func(g string, seq int) time.Duration {
			t.Helper()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			t0 := time.Now()
			if err := snd.Send(ctx, clusterMsg(g, 2, seq), nil); err != nil {
				t.Fatalf("send %s/%d to node 2: %v", g, seq, err)
			}
			return time.Since(t0)
		}
		handledBy := func(g string, seq int) []int {
			var subs []int
			for _, h := range r.handled() {
				if h.group == g && h.seq == seq && h.src == 2 {
					subs = append(subs, h.sub)
				}
			}
			return subs
		}

		// A group node 2 holds: routed at once, handled on node 2.
		known := send(g2, per)
		waitFor(t, 30*time.Second, g2+" handled", func() bool { return len(handledBy(g2, per)) > 0 })
		// A group node 1 holds: accepted at once, parked for node 1.
		parkedFor1 := send(g1, per)
		// A new group: no decision without the LOCAL handler.
		newGroup := send("new", 0)
		waitFor(t, 30*time.Second, "the new group's first message handled", func() bool { return len(handledBy("new", 0)) > 0 })
		firstOn := handledBy("new", 0)
		if known > 2*time.Second || parkedFor1 > 2*time.Second {
			t.Errorf("sends of groups with a decision took %v and %v with the LOCAL node down, want < 2 s", known, parkedFor1)
		}
		if newGroup < 5*time.Second {
			t.Errorf("a new group's first message was routed in %v with the LOCAL node down: Artemis should have waited for a decision", newGroup)
		}
		if n := len(handledBy(g1, per)); n != 0 {
			t.Fatalf("%s (node 1's group) handled %d times while node 1 was down", g1, n)
		}

		restart := tp.timed(t, "start-node", "1")
		t0 := time.Now()
		waitFor(t, 2*time.Minute, g1+" handled after node 1's restart", func() bool { return len(handledBy(g1, per)) > 0 })
		resumed := time.Since(t0)
		second := send("new", 1)
		waitFor(t, 30*time.Second, "the new group's second message handled", func() bool { return len(handledBy("new", 1)) > 0 })
		secondOn := handledBy("new", 1)
		if !slices.Equal(handledBy(g1, per), []int{0}) || !slices.Equal(handledBy(g2, per), []int{1}) {
			t.Errorf("%s handled by %v (want node 1's subscriber), %s by %v (want node 2's)", g1, handledBy(g1, per), g2, handledBy(g2, per))
		}
		t.Logf("LOCAL node killed: a send of %s (held by node 2) took %v, of %s (held by node 1) %v and was kept for node 1, "+
			"of a new group %v (then routed without grouping, to the subscriber of node %d); node 1 restarted in %v, "+
			"%s handled on node 1 %v after that; the new group's next message (send %v) went to node %d",
			g2, known.Round(time.Millisecond), g1, parkedFor1.Round(time.Millisecond), newGroup.Round(time.Millisecond),
			firstOn[0]+1, restart.Round(time.Millisecond), g1, resumed.Round(time.Millisecond),
			second.Round(time.Millisecond), secondOn[0]+1)
	})
}
