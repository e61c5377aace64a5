{{/*
The router worker group of the RayCluster: each pod runs `splitserve router`, which joins Ray
with one splitserve_router slot (no GPU, no replica slot) and serves one router replica on the
pod. The router Service selects these pods, so the API stays up while the head pod restarts.
*/}}
{{- define "splitserve.routerGroup" -}}
{{- $v := .Values }}
{{- $r := $v.router }}
- groupName: router
  replicas: {{ $r.replicas }}
  minReplicas: {{ $r.replicas }}
  maxReplicas: {{ $r.replicas }}
  rayStartParams:
    num-cpus: {{ $r.cpus | quote }}
    num-gpus: "0"
    resources: '"{\"splitserve_router\": 1}"'
  template:
    metadata:
      labels:
        {{- include "splitserve.labels" . | nindent 8 }}
        app.kubernetes.io/component: router
    spec:
      # The router stops taking calls on SIGTERM and lets the running ones finish.
      terminationGracePeriodSeconds: {{ add $r.stopGraceS 30 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.clusterTLS.enabled }}
      {{- include "splitserve.clusterTLS.initContainers" (dict "root" . "dns" list) | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-router
          image: {{ include "splitserve.image" . }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["splitserve"]
          args:
            - router
            - --address
            - $(FQ_RAY_IP):6379
            - --router-id
            - $(POD_NAME)
            - --num-cpus
            - {{ $r.cpus | quote }}
            - --stop-grace-s
            - {{ $r.stopGraceS | quote }}
            - --host
            - 0.0.0.0
            - --port
            - {{ $r.grpcPort | quote }}
            {{- if $r.http.enabled }}
            - --http-port
            - {{ $r.http.port | quote }}
            {{- end }}
            - --metrics-host
            - 0.0.0.0
            - --metrics-port
            - {{ $r.metricsPort | quote }}
            {{- if $v.tls.enabled }}
            - --tls-cert
            - /etc/splitserve/tls/tls.crt
            - --tls-key
            - /etc/splitserve/tls/tls.key
            {{- end }}
            {{- if $v.auth.enabled }}
            - --token-file
            - /etc/splitserve/auth/{{ $v.auth.secretKey }}
            {{- end }}
            {{- if $v.clusterTLS.enabled }}
            {{- include "splitserve.clusterTLS.args" . | nindent 12 }}
            {{- end }}
            {{- range $r.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $r.grpcPort }}
            {{- if $r.http.enabled }}
            - name: http
              containerPort: {{ $r.http.port }}
            {{- end }}
            - name: metrics
              containerPort: {{ $r.metricsPort }}
          # Ready once the router serves: the gRPC health service (no token needed); the
          # kubelet's gRPC probe cannot speak TLS, so with TLS the port being open counts.
          readinessProbe:
            {{- if $v.tls.enabled }}
            tcpSocket:
              port: grpc
            {{- else }}
            grpc:
              port: {{ $r.grpcPort }}
            {{- end }}
            periodSeconds: 10
            failureThreshold: 3
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            {{- include "splitserve.env" . | nindent 12 }}
            {{- with include "splitserve.gcsReconnectEnv" . }}
            {{- . | nindent 12 }}
            {{- end }}
          resources:
            requests:
              cpu: {{ $r.cpus | quote }}
              memory: {{ $r.memory }}
            limits:
              cpu: {{ $r.cpus | quote }}
              memory: {{ $r.memory }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: cache
              mountPath: /var/cache/splitserve
            {{- if $v.clusterTLS.enabled }}
            - name: cluster-tls
              mountPath: /etc/splitserve/cluster-tls
              readOnly: true
            {{- end }}
            {{- if $v.tls.enabled }}
            - name: tls
              mountPath: /etc/splitserve/tls
              readOnly: true
            {{- end }}
            {{- if $v.auth.enabled }}
            - name: auth
              mountPath: /etc/splitserve/auth
              readOnly: true
            {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $r.shmSize }}
        - name: cache
          emptyDir: {}
        {{- if $v.clusterTLS.enabled }}
        - name: cluster-ca
          secret:
            secretName: {{ $v.clusterTLS.caSecretName }}
            defaultMode: 0400
        - name: cluster-tls
          emptyDir:
            medium: Memory
        {{- end }}
        {{- if $v.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ $v.tls.secretName }}
        {{- end }}
        {{- if $v.auth.enabled }}
        - name: auth
          secret:
            secretName: {{ $v.auth.secretName }}
        {{- end }}
      {{- with $r.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $r.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
