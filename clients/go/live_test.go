package mmcache

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// Live tests: the client against a real `mmcache serve` at MMCACHE_URL, with the
// bearer tokens in MMCACHE_TOKEN (writes, /v1/state) and MMCACHE_MATCH_TOKEN (match)
// when the service requires them. `make test` starts one
// (tests/integration/test_go_client.py). Use a scratch service: the sync test drops
// every endpoint that is not its own.

// eventuallyTimeout bounds every wait for a write to show in /v1/match (eventual).
const eventuallyTimeout = 15 * time.Second

func liveClient(t *testing.T, opts ...Option) *Client {
	t.Helper()
	url := os.Getenv("MMCACHE_URL")
	if url == "" {
		t.Skip("MMCACHE_URL is not set: start a scratch `mmcache serve` and run " +
			"MMCACHE_URL=http://127.0.0.1:8080 go test ./... (make test does this)")
	}
	base := []Option{WithMatchTimeout(5 * time.Second), WithWriteTimeout(10 * time.Second)}
	if tok := os.Getenv("MMCACHE_TOKEN"); tok != "" {
		base = append(base, WithToken(tok))
	}
	if tok := os.Getenv("MMCACHE_MATCH_TOKEN"); tok != "" {
		base = append(base, WithMatchToken(tok))
	}
	return newClient(t, url, append(base, opts...)...)
}

// names returns endpoint names unique to this test run, "go-<test>-<nanos>/<pod>".
func names(t *testing.T, pods ...string) []string {
	ns := fmt.Sprintf("go-%s-%d", strings.ToLower(t.Name()), time.Now().UnixNano())
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = ns + "/" + p
	}
	return out
}

// tokenized is a match body naming items by hash, with their sizes as lengths.
func tokenized(items ...Item) map[string]any {
	features := make([]map[string]any, len(items))
	for i, it := range items {
		features[i] = map[string]any{"hash": it.Hash, "modality": it.Modality, "offset": 0, "length": it.Size}
	}
	return map[string]any{"tokenized": map[string]any{"prompts": []any{map[string]any{"mm_features": features}}}}
}

// waitFor polls Match until cond holds for its answer, failing after eventuallyTimeout.
func waitFor(t *testing.T, c *Client, req MatchRequest, what string, cond func(*MatchResponse) bool) *MatchResponse {
	t.Helper()
	deadline := time.Now().Add(eventuallyTimeout)
	for {
		resp, err := c.Match(context.Background(), req)
		if err != nil {
			t.Fatalf("match: %v", err)
		}
		if cond(resp) {
			return resp
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v; last answer %+v", what, eventuallyTimeout, resp)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestLivePlaceThenMatch(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a", "pod-b")
	seen := Item{Hash: eps[0] + "#img", Size: 3, Modality: "image"}
	also := Item{Hash: eps[0] + "#vid", Size: 1, Modality: "video"}
	acc, err := c.Place(context.Background(), PlacementRequest{RequestID: "r-1", Endpoints: eps[:1], Items: []Item{seen, also}})
	if err != nil {
		t.Fatal(err)
	}
	if acc.Events != 1 {
		t.Fatalf("events = %d, want 1 (one endpoint)", acc.Events)
	}
	req := MatchRequest{Endpoints: eps, Body: tokenized(seen, also)}
	resp := waitFor(t, c, req, "placement visible", func(r *MatchResponse) bool { return r.Score(eps[0]) == 1 })
	a, b := resp.Endpoints[0], resp.Endpoints[1]
	if a.Endpoint != eps[0] || a.MatchedWeight != 4 || a.TotalWeight != 4 || len(a.MatchedItems) != 2 || a.MatchedItems[0] != seen {
		t.Errorf("pod-a = %+v", a)
	}
	if b.Endpoint != eps[1] || b.Score != 0 || b.TotalWeight != 4 || len(b.MatchedItems) != 0 {
		t.Errorf("pod-b = %+v", b)
	}
	if len(resp.RequestItems) != 2 || resp.RequestItems[0] != seen || resp.RequestItems[1] != also {
		t.Errorf("request_items = %+v", resp.RequestItems)
	}
	// a request with one known and one new item of equal total weight: score 3/4
	unseen := Item{Hash: eps[0] + "#new", Size: 1, Modality: "audio"}
	partial, err := c.Match(context.Background(), MatchRequest{Endpoints: eps[:1], Body: tokenized(seen, unseen)})
	if err != nil {
		t.Fatal(err)
	}
	if m := partial.Endpoints[0]; m.Score != 0.75 || m.MatchedWeight != 3 || m.TotalWeight != 4 {
		t.Errorf("partial match = %+v, want 3/4", m)
	}
}

func TestLivePlaceByBodyThenMatch(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a", "pod-b", "pod-c")
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":[
		{"type":"text","text":"what is this?"},
		{"type":"image_url","image_url":{"url":"https://example.com/` + eps[0] + `.png"}}]}]}`)
	acc, err := c.Place(context.Background(), PlacementRequest{Endpoints: eps[:2], Body: ChatCompletions(chat)})
	if err != nil {
		t.Fatal(err)
	}
	if acc.Events != 2 {
		t.Fatalf("events = %d, want 2 (two endpoints)", acc.Events)
	}
	req := MatchRequest{Endpoints: eps, Body: ChatCompletions(chat)}
	resp := waitFor(t, c, req, "placement by body visible", func(r *MatchResponse) bool {
		return r.Score(eps[0]) == 1 && r.Score(eps[1]) == 1
	})
	if resp.Score(eps[2]) != 0 || len(resp.RequestItems) != 1 || resp.RequestItems[0].Modality != "image" {
		t.Errorf("answer = %+v", resp)
	}
}

func TestLiveDeleteEndpoint(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a", "pod-b")
	it := Item{Hash: eps[0] + "#img", Size: 1, Modality: "image"}
	if _, err := c.Place(context.Background(), PlacementRequest{Endpoints: eps, Items: []Item{it}}); err != nil {
		t.Fatal(err)
	}
	req := MatchRequest{Endpoints: eps, Body: tokenized(it)}
	waitFor(t, c, req, "placement visible", func(r *MatchResponse) bool { return r.Score(eps[0]) == 1 && r.Score(eps[1]) == 1 })
	acc, err := c.DeleteEndpoint(context.Background(), eps[0])
	if err != nil {
		t.Fatal(err)
	}
	if acc.Events != 1 {
		t.Fatalf("events = %d, want 1", acc.Events)
	}
	resp := waitFor(t, c, req, "deletion visible", func(r *MatchResponse) bool { return r.Score(eps[0]) == 0 })
	if resp.Score(eps[1]) != 1 {
		t.Errorf("deleting pod-a dropped pod-b too: %+v", resp)
	}
}

func TestLiveSyncEndpoints(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a", "pod-b")
	it := Item{Hash: eps[0] + "#img", Size: 1, Modality: "image"}
	if _, err := c.Place(context.Background(), PlacementRequest{Endpoints: eps, Items: []Item{it}}); err != nil {
		t.Fatal(err)
	}
	req := MatchRequest{Endpoints: eps, Body: tokenized(it)}
	waitFor(t, c, req, "placement visible", func(r *MatchResponse) bool { return r.Score(eps[0]) == 1 && r.Score(eps[1]) == 1 })
	// an empty live set is ignored, never a wipe
	if acc, err := c.SyncEndpoints(context.Background(), nil); err != nil || acc.Events != 0 {
		t.Fatalf("empty sync: %+v, %v", acc, err)
	}
	acc, err := c.SyncEndpoints(context.Background(), eps[1:])
	if err != nil {
		t.Fatal(err)
	}
	if acc.Events < 1 {
		t.Fatalf("events = %d, want at least 1", acc.Events)
	}
	resp := waitFor(t, c, req, "sync visible", func(r *MatchResponse) bool { return r.Score(eps[0]) == 0 })
	if resp.Score(eps[1]) != 1 {
		t.Errorf("the live pod lost its entries: %+v", resp)
	}
	state, err := c.State(context.Background(), 1000)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range state.Endpoints {
		if e.Endpoint == eps[0] {
			t.Errorf("/v1/state still lists the synced-away %s", eps[0])
		}
	}
	if state.Digest == "" || state.Capacity.PerEndpoint < 1 {
		t.Errorf("state = %+v", state)
	}
}

func TestLiveBadRequestIsATypedError(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a")
	_, err := c.Place(context.Background(), PlacementRequest{Endpoints: eps, Items: []Item{{Hash: "h", Size: 0, Modality: "image"}}})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("err = %v, want *Error", err)
	}
	if e.Status != 400 || e.Code == "" || !strings.Contains(e.Message, "size") {
		t.Errorf("err = %#v, want 400 naming size", e)
	}
	if e.NotAcknowledged() {
		t.Error("a 400 is not a NotAcknowledged()")
	}
	// a match without a body: 400 naming the field
	_, err = c.Match(context.Background(), MatchRequest{Endpoints: eps})
	if !errors.As(err, &e) || e.Status != 400 || !strings.Contains(e.Message, "body") {
		t.Errorf("match without body: %v", err)
	}
}

func TestLiveMissingTokenIsUnauthorized(t *testing.T) {
	c := liveClient(t)
	if os.Getenv("MMCACHE_TOKEN") == "" || os.Getenv("MMCACHE_MATCH_TOKEN") == "" {
		t.Skip("MMCACHE_TOKEN and MMCACHE_MATCH_TOKEN are not set: the service is not protected")
	}
	anonymous := newClient(t, c.base, WithMatchTimeout(5*time.Second))
	eps := names(t, "pod-a")
	_, err := anonymous.Place(context.Background(), PlacementRequest{Endpoints: eps, Items: []Item{{Hash: "h", Size: 1, Modality: "image"}}})
	var e *Error
	if !errors.As(err, &e) || e.Status != 401 || e.Code != "unauthorized" {
		t.Errorf("write without token: %v", err)
	}
	wrong := newClient(t, c.base, WithToken("not-the-token"), WithMatchTimeout(5*time.Second))
	_, err = wrong.Match(context.Background(), MatchRequest{Endpoints: eps, Body: map[string]any{}})
	if !errors.As(err, &e) || e.Status != 401 {
		t.Errorf("match with a wrong token: %v", err)
	}
	// MatchOrNone turns it into "no match" as well
	resp, err := wrong.MatchOrNone(context.Background(), MatchRequest{Endpoints: eps, Body: map[string]any{}})
	if err == nil || len(resp.Endpoints) != 1 || resp.Endpoints[0].Score != 0 {
		t.Errorf("MatchOrNone with a wrong token: %+v, %v", resp, err)
	}
}

func TestLiveFallbackOnADeadline(t *testing.T) {
	c := liveClient(t, WithMatchTimeout(time.Microsecond))
	eps := names(t, "pod-a", "pod-b")
	resp, err := c.MatchOrNone(context.Background(), MatchRequest{Endpoints: eps, Body: tokenized(Item{"h", 1, "image"})})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want a deadline", err)
	}
	assertNoMatch(t, resp, eps...)
}

func TestLiveMatchFitsTheDefaultTimeout(t *testing.T) {
	c := liveClient(t, WithMatchTimeout(DefaultMatchTimeout))
	eps := names(t, "pod-a")
	// on a loaded test machine one call may miss 50 ms; most must not
	ok := 0
	for i := 0; i < 20; i++ {
		if _, err := c.Match(context.Background(), MatchRequest{Endpoints: eps, Body: tokenized(Item{"h", 1, "image"})}); err == nil {
			ok++
		}
	}
	if ok < 10 {
		t.Errorf("%d of 20 matches answered within %v", ok, DefaultMatchTimeout)
	}
}

func TestLiveItemUUIDsKeepTheHashesWhicheverAPICarriedTheImage(t *testing.T) {
	c := liveClient(t)
	eps := names(t, "pod-a", "pod-b")
	url := "https://example.com/" + eps[0] + ".png"
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":[
		{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"` + url + `"}}]}]}`)
	named, err := SetItemUUIDs(chat)
	if err != nil {
		t.Fatal(err)
	}
	uuid := partsOf(t, named, "messages")[0][1]["uuid"]
	// the gateway sends the named body to vLLM, and places it (plain, unwrapped)
	if _, err := c.Place(context.Background(), PlacementRequest{Endpoints: eps[:1], Body: json.RawMessage(named)}); err != nil {
		t.Fatal(err)
	}
	// a match on the body without uuids, and on a Responses body with the same image URL,
	// finds the item the named body placed: one hash for all three
	responses := []byte(`{"model":"m","input":[{"role":"user","content":[
		{"type":"input_text","text":"what is this?"},{"type":"input_image","image_url":"` + url + `","detail":"auto"}]}]}`)
	for _, body := range []json.RawMessage{ChatCompletions(chat), Responses(responses), responses} {
		resp := waitFor(t, c, MatchRequest{Endpoints: eps, Body: body}, "placement by the named body visible",
			func(r *MatchResponse) bool { return r.Score(eps[0]) == 1 })
		if len(resp.RequestItems) != 1 || resp.RequestItems[0].Hash != uuid || resp.RequestItems[0].Hash != ItemHash("image_url", url) {
			t.Errorf("request_items = %+v, want the uuid %v", resp.RequestItems, uuid)
		}
		if resp.Score(eps[1]) != 0 {
			t.Errorf("pod-b = %+v", resp.Endpoints[1])
		}
		for _, m := range resp.Endpoints {
			if m.Source != "estimate" { // no engine reports: both are matched against their estimate
				t.Errorf("%s source = %q, want estimate", m.Endpoint, m.Source)
			}
		}
	}
}
