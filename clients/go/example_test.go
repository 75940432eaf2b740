package mmcache_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"testing"
	"time"

	"mmcache/clients/go/mmcache"
)

// gatewayPlugin is what the in-process mm-embeddings-cache-producer plugin and its
// scorer become when the state lives in mmcache: the same hooks, each one call.
type gatewayPlugin struct {
	mm *mmcache.Client
	// weight of the encoder-cache scorer in the scheduling profile (4 in the
	// plugin's example, beside load scorers weighted 2 each)
	weight float64
}

// request is the gateway's view of one inference request.
type request struct {
	id    string
	body  []byte         // the OpenAI chat-completions body as received
	items []mmcache.Item // set by Produce, used by PreRequest
}

// Produce runs during scheduling, once per request, before the scorers: it asks
// which candidate pods probably hold the request's images, videos and audio. It
// never fails the request: when mmcache is slow or down every pod scores 0.
func (p *gatewayPlugin) Produce(ctx context.Context, req *request, candidates []string) map[string]float64 {
	scores, items, err := p.mm.Scores(ctx, candidates, mmcache.ChatCompletions(req.body))
	if err != nil {
		log.Printf("mmcache match failed, scoring 0: %v", err) // count it, rate-limit the log
	}
	req.items = items
	return scores
}

// Score is the scorer's contribution to each candidate: score in [0, 1] times its
// weight, added by the scheduler to the other scorers' weighted scores.
func (p *gatewayPlugin) Score(scores map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(scores))
	for pod, s := range scores {
		out[pod] = p.weight * s
	}
	return out
}

// PreRequest runs once the scheduler picked the pod(s): record the placement. It is
// off the hot path: fire and forget with its own bounded timeout, not the request's
// context, which ends with the request.
func (p *gatewayPlugin) PreRequest(req *request, chosen []string) <-chan error {
	done := make(chan error, 1)
	if len(req.items) == 0 { // nothing multimodal: nothing to record
		done <- nil
		return done
	}
	go func() {
		_, err := p.mm.Place(context.Background(), mmcache.PlacementRequest{
			RequestID: req.id, Endpoints: chosen, Items: req.items})
		done <- err // a NotAcknowledged() error may still have been written
	}()
	return done
}

// EndpointDeleted runs when a pod leaves the pool (the plugin's Extract on an
// endpoint deletion event).
func (p *gatewayPlugin) EndpointDeleted(pod string) error {
	_, err := p.mm.DeleteEndpoint(context.Background(), pod)
	return err
}

// Sweep runs periodically with the gateway's current pod list: any pod mmcache
// still tracks but the list lacks (a deletion event that was missed) is dropped.
func (p *gatewayPlugin) Sweep(pods []string) error {
	if len(pods) == 0 { // an empty list is a broken watch, not an empty pool
		return nil
	}
	_, err := p.mm.SyncEndpoints(context.Background(), pods)
	return err
}

// Example_gatewayPlugin shows the calls a gateway makes per request and per pod event.
func Example_gatewayPlugin() {
	mm, err := mmcache.New("http://mmcache:8080",
		mmcache.WithToken(os.Getenv("MMCACHE_TOKEN")), // --auth-token-file / --match-auth-token-file
		mmcache.WithMatchTimeout(50*time.Millisecond), // scheduling path
		mmcache.WithWriteTimeout(3*time.Second))       // off the hot path
	if err != nil {
		log.Fatal(err)
	}
	plugin := &gatewayPlugin{mm: mm, weight: 4}
	req := &request{id: "r-1", body: []byte(`{"model":"m","messages":[{"role":"user","content":[
		{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}`)}
	candidates := []string{"default/vllm-0", "default/vllm-1"}

	weighted := plugin.Score(plugin.Produce(context.Background(), req, candidates))
	chosen := pick(weighted) // with the other scorers' weighted scores added in
	plugin.PreRequest(req, []string{chosen})

	_ = plugin.EndpointDeleted("default/vllm-1") // the pod is gone
	_ = plugin.Sweep([]string{"default/vllm-0"}) // every minute, say
}

// pick stands for the scheduler: the highest total wins.
func pick(total map[string]float64) string {
	best, bestScore := "", -1.0
	for pod, s := range total {
		if s > bestScore || (s == bestScore && pod < best) {
			best, bestScore = pod, s
		}
	}
	return best
}

// TestLiveGatewayPlugin runs the example's hooks against the service at MMCACHE_URL:
// a second request with the same image is steered to the pod that served the first.
func TestLiveGatewayPlugin(t *testing.T) {
	url := os.Getenv("MMCACHE_URL")
	if url == "" {
		t.Skip("MMCACHE_URL is not set: start a scratch `mmcache serve` and run " +
			"MMCACHE_URL=http://127.0.0.1:8080 go test ./... (make test does this)")
	}
	opts := []mmcache.Option{mmcache.WithToken(os.Getenv("MMCACHE_TOKEN")), mmcache.WithMatchTimeout(5 * time.Second)}
	if tok := os.Getenv("MMCACHE_MATCH_TOKEN"); tok != "" {
		opts = append(opts, mmcache.WithMatchToken(tok))
	}
	mm, err := mmcache.New(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	plugin := &gatewayPlugin{mm: mm, weight: 4}
	ns := fmt.Sprintf("go-plugin-%d", time.Now().UnixNano())
	pods := []string{ns + "/vllm-0", ns + "/vllm-1", ns + "/vllm-2"}
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []any{map[string]any{
		"role": "user", "content": []any{
			map[string]any{"type": "text", "text": "describe"},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": "https://example.com/" + ns + ".png"}},
		}}}})
	ctx := context.Background()

	first := &request{id: "r-1", body: body}
	if s := plugin.Produce(ctx, first, pods); s[pods[0]] != 0 || s[pods[1]] != 0 || s[pods[2]] != 0 {
		t.Fatalf("a new image already matches: %v", s)
	}
	if len(first.items) != 1 {
		t.Fatalf("items = %v, want the one image", first.items)
	}
	if err := <-plugin.PreRequest(first, pods[1:2]); err != nil {
		t.Fatal(err)
	}

	deadline := time.Now().Add(15 * time.Second)
	for {
		second := &request{id: "r-2", body: body}
		weighted := plugin.Score(plugin.Produce(ctx, second, pods))
		if pick(weighted) == pods[1] {
			if weighted[pods[1]] != 4 || weighted[pods[0]] != 0 {
				t.Fatalf("weighted scores = %v, want 4 for vllm-1 only", weighted)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second request is not steered to vllm-1: %v", weighted)
		}
		time.Sleep(20 * time.Millisecond)
	}

	if err := plugin.EndpointDeleted(pods[1]); err != nil {
		t.Fatal(err)
	}
	for {
		s := plugin.Produce(ctx, &request{id: "r-3", body: body}, pods)
		if s[pods[1]] == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the deleted pod still matches: %v", s)
		}
		time.Sleep(20 * time.Millisecond)
	}
	third := &request{id: "r-3", body: body}
	plugin.Produce(ctx, third, pods)
	if err := <-plugin.PreRequest(third, pods[2:]); err != nil {
		t.Fatal(err)
	}
	for {
		if s := plugin.Produce(ctx, &request{id: "r-4", body: body}, pods); s[pods[2]] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the placement on vllm-2 does not show")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := plugin.Sweep(nil); err != nil {
		t.Fatal(err)
	}
	if err := plugin.Sweep(pods[:1]); err != nil { // vllm-2 is no longer in the pod list
		t.Fatal(err)
	}
	for {
		if s := plugin.Produce(ctx, &request{id: "r-5", body: body}, pods); s[pods[2]] == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sweep did not drop vllm-2")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
